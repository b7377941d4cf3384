"""The ending the source-checking tool tests share: print each failure, a summary, an exit
status (0 only if nothing failed)."""


def report(failures, summary):
    for f in failures:
        print("FAIL:", f)
    print(f"{summary}, {len(failures)} failures")
    return 1 if failures else 0
