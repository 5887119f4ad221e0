"""The N slowest tests of pytest JUnit XML reports (--junitxml), with their tier and seconds:
`python scripts/slowest_tests.py 20 reports/*.xml` (.ci/run prints this after its tiers, one
report per tier named <tier>.xml)."""
import os
import sys
import xml.etree.ElementTree as ElementTree


def timed_tests(paths: list[str]) -> list[tuple[float, str, str]]:
    """(seconds, tier, test id) of every test case in the reports."""
    rows = []
    for path in paths:
        tier = os.path.splitext(os.path.basename(path))[0]
        for case in ElementTree.parse(path).iter('testcase'):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            rows.append((float(case.get('time') or 0.0), tier, name))
    return sorted(rows, reverse=True)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print(__doc__.strip(), file=sys.stderr)
        return 2
    count, paths = int(argv[0]), [p for p in argv[1:] if os.path.isfile(p)]
    rows = timed_tests(paths)
    print(f'The {min(count, len(rows))} slowest of {len(rows)} tests:')
    for seconds, tier, name in rows[:count]:
        print(f'  {seconds:7.1f} s  {tier:<5}  {name}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
