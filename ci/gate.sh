#!/usr/bin/env bash
# CI gate, run by .ci/run after the test suite: every slice marked implemented/verified on the cpu platform
# must pass `dsv4 verify` (its tests -- reused from the suite's junit report -- and its golden checks).
# Exit codes are dsv4's: 0 pass, 1 regression, 2 cannot judge (a missing golden is never a pass).
set -euo pipefail
cd "$(dirname "$0")/.."
junit="${1:-reports/junit.xml}"
[ -f "$junit" ] || { echo "ci/gate.sh: $junit not found (run README's test command first)" >&2; exit 2; }
dsv4 verify --platform cpu --junit "$junit" --report reports/verify
