#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh --test). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
