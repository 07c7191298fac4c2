#!/usr/bin/env bash
# Fresh-machine check: install dgemma NON-editable into a new venv and use it from a directory outside the
# repository, so nothing may read repository-relative paths (tests/, configs/ via parents[...], templates).
# The venv sees the current environment's packages (--system-site-packages: no downloads) but gets its own,
# non-editable copy of dgemma, which must be the one imported.
# Usage: .ci/fresh_machine.sh [WORKDIR]   (default: a new temporary directory, removed at the end)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
if [[ $# -ge 1 ]]; then WORK="$1"; mkdir -p "$WORK"; else WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT; fi
WORK="$(cd "$WORK" && pwd)"
case "$WORK/" in "$REPO"/*) echo "fresh_machine: WORKDIR must be outside the repository" >&2; exit 2;; esac

"$PY" -m venv --system-site-packages --without-pip "$WORK/venv"
# --system-site-packages exposes the *base* interpreter's packages; when the current python is itself a venv, also
# expose its site-packages (a plain path .pth: the .pth files in there, e.g. an editable dgemma's finder, stay inactive)
"$PY" - "$WORK/venv" <<'PYEOF'
import pathlib, site, subprocess, sys
if sys.prefix != sys.base_prefix:
    target = subprocess.run([sys.argv[1] + "/bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(target, "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
PYEOF
# build from a copy of the sources (an in-tree build would leave build/ in the checkout); setuptools comes from the
# current environment (--no-build-isolation)
mkdir -p "$WORK/src"
tar -C "$REPO" --exclude=./.git --exclude=./runs --exclude=./build --exclude=./dist --exclude='*.egg-info' \
  --exclude=__pycache__ -cf - . | tar -C "$WORK/src" -xf -
"$WORK/venv/bin/python" -m pip install -q --no-deps --no-build-isolation "$WORK/src"  # the current pip/setuptools
rm -rf "$WORK/src"

mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
where="$("$WORK/venv/bin/python" -c 'import dgemma, os; print(os.path.realpath(dgemma.__file__))')"
case "$where" in
  "$WORK/venv/"*) ;;
  *) echo "fresh_machine: dgemma imported from $where, not from the fresh venv" >&2; exit 1;;
esac
echo "fresh_machine: dgemma from $where"
"$WORK/venv/bin/dgemma" demo
"$WORK/venv/bin/dgemma" plan configs/stage1/tiny.yaml --devices 1 --accelerator h100
"$WORK/venv/bin/dgemma" plan configs/stage1/gemma4_26b_a4b.yaml --devices 64 --accelerator h200 \
  --out "$WORK/elsewhere/plan_out" || { rc=$?; [[ $rc -eq 1 ]] || exit $rc; }  # 1 = "does not fit": still planned
test -s "$WORK/elsewhere/plan_out/resolved_config.yaml"
echo "fresh_machine: OK (non-editable install, run from $WORK/elsewhere)"
