"""Sums the GoogleTest JSON reports under a folder; prints skip reasons and one closing count line."""
import collections
import json
import pathlib
import sys

passed = failed = skipped = 0
reasons = collections.Counter()
for report in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for suite in json.loads(report.read_text())["testsuites"]:
        for case in suite["testsuite"]:
            if case.get("result") == "SKIPPED":
                skipped += 1
                messages = [s.get("message", "") for s in case.get("skipped", [])] or ["(no reason given)"]
                reasons[messages[0].strip().splitlines()[-1]] += 1
            elif case.get("failures"):
                failed += 1
            elif case.get("status") == "RUN":
                passed += 1
if reasons:
    print("skipped, by reason:")
    for reason, count in reasons.most_common():
        print(f"  {count:4d}  {reason}")
print(f"zoe tests: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
