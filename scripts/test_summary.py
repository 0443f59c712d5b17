"""Sums the JUnit-style XML reports under a folder (GoogleTest's, and pytest's --junitxml, whose test cases
carry no status attribute and report errors apart from failures); prints skip reasons and one closing count
line. A report named <suite>.isa-<isa> holds a run with ZOE_ISA=<isa>; failures are listed with it."""
import collections
import pathlib
import sys
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
reasons = collections.Counter()
failures = []
for report in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for case in ET.parse(report).getroot().iter("testcase"):
        skip = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            failures.append(f"{report.stem}: {case.get('classname', '')}.{case.get('name', '')}")
        elif skip is not None or case.get("result") == "skipped":
            skipped += 1
            message = (skip.get("message", "") if skip is not None else "").strip()
            reasons[f"{report.stem}: {message.splitlines()[-1] if message else '(no reason given)'}"] += 1
        elif case.get("status", "run") == "run":
            passed += 1
if reasons:
    print("skipped, by reason:")
    for reason, count in reasons.most_common():
        print(f"  {count:4d}  {reason}")
if failures:
    print("failed, by suite (.isa-X: run with ZOE_ISA=X):")
    for failure in failures:
        print(f"  {failure}")
print(f"zoe tests: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
