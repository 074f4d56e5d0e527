#!/usr/bin/env bash
# Downloads the pinned engine wheels and dependencies and builds what the
# engine harness carries (see prepare.py): .engine-wheels/carry/ at the
# repository root (git-ignored), its MANIFEST.txt with the total size.
#
#   bash python/engine_checks/prepare.sh [--keep-downloads]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/prepare.py" "$@"
