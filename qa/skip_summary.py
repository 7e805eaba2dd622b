"""Print one line that counts the skipped tests of JUnit XML reports by reason.

    python qa/skip_summary.py REPORT.xml ...

The reasons are pytest's skip messages, each with its count in brackets (as pytest's
``-rs`` writes them), most frequent first. Used at the end of
qa/L0_pytorch_unittest/test.sh, where the per-file runs are quiet (-q hides skip
reasons).
"""

import collections
import sys
import xml.etree.ElementTree as ET


def skip_reasons(paths):
    """Counter of skip reasons over the reports."""
    reasons = collections.Counter()
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue                       # a file whose run died writes no report
        for skipped in root.iter("skipped"):
            message = skipped.get("message") or skipped.text or "no reason given"
            reasons[message.strip()] += 1
    return reasons


def summary(reasons) -> str:
    total = sum(reasons.values())
    if not total:
        return "Skipped: none."
    parts = [f"[{n}] {reason}" for reason, n in reasons.most_common()]
    return f"Skipped {total} tests by reason: " + "; ".join(parts)


if __name__ == "__main__":
    print(summary(skip_reasons(sys.argv[1:])))
