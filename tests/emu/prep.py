# Turns a .cu file into C++ the emulator compiles: <<<...>>> launches, extern __shared__.
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r'(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\((.*?)\);', lambda m: 'emu_launch([=]{ %s(%s); }, %s);' % (m.group(1), m.group(3), m.group(2)), s, flags=re.S)
s = re.sub(r'extern __shared__ (\w+) (\w+)\[\];', r'\1 *\2 = (\1 *)emu_dyn_smem();', s)
open(sys.argv[2], 'w').write('#line 1 "%s"\n' % sys.argv[1] + s)
