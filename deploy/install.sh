#!/usr/bin/env bash
# Install worldtap (editable) into the current Python environment.
#   bash deploy/install.sh          the package
#   bash deploy/install.sh dev      with the test and lint tools (and Isaac Lab's dataset
#                                   reader, which the export tests check against)
# torch is installed only when it is missing, pinned to the CPU build 2.13.0; a torch that is
# already there (your simulator's CUDA build, say) is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "worldtap: torch is missing; installing torch==2.13.0" >&2
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras="${1:-}"
target="."
[ -n "$extras" ] && target=".[$extras]"
"$PY" -m pip install --quiet --disable-pip-version-check -e "$target"
case ",$extras," in
  *,dev,*)
    # Isaac Lab's wheel without its dependencies (Isaac Sim and a pinned stack): the tests
    # import only isaaclab.utils.datasets, whose imports the dev extra installs.
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "isaaclab==2.3.2.post1"
    ;;
esac
