# Turns a .cu file into C++ the emulator compiles: <<<...>>> launches, extern __shared__, and
# static __shared__ variables, each of which gets one copy per block slot (emu.h: EMU_SLOTS;
# one slot but under ThreadSanitizer, where blocks in different slots are not ordered and so
# must not share memory).
import re, sys


def slotted(m):
    align, typ, decls = m.group(1) or '', m.group(2), m.group(3)
    out = []
    for d in decls.split(','):
        dm = re.fullmatch(r'\s*(\w+)\s*((?:\[[^\]]*\])*)\s*', d)
        if not dm:
            sys.exit('prep.py: cannot read the __shared__ declaration %r' % m.group(0))
        name, dims = dm.group(1), dm.group(2)
        out.append('struct emu_sh_%s { %s%s v%s; }; static emu_sh_%s emu_sh_%s_slots[EMU_SLOTS]; '
                   'auto &%s = emu_sh_%s_slots[emu_slot].v;' % (name, align, typ, dims, name, name, name, name))
    return ' '.join(out)


s = open(sys.argv[1]).read()
s = re.sub(r'(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\((.*?)\);', lambda m: 'emu_launch([=]{ %s(%s); }, %s);' % (m.group(1), m.group(3), m.group(2)), s, flags=re.S)
s = re.sub(r'extern __shared__ (\w+) (\w+)\[\];', r'\1 *\2 = (\1 *)emu_dyn_smem();', s)
s = re.sub(r'__shared__\s+(__align__\(\d+\)\s+)?((?:struct\s+)?\w+)\s+([^;]+);', slotted, s)
open(sys.argv[2], 'w').write('#line 1 "%s"\n' % sys.argv[1] + s)
