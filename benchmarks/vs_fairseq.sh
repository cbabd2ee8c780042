#!/usr/bin/env bash
# megamlm vs the reference implementation, the EIFY/fairseq fork, side by side on this machine's CPU:
#   bash benchmarks/vs_fairseq.sh [SNAPSHOT] [-- vs_fairseq.py options]
# SNAPSHOT: a clone of github.com/EIFY/fairseq or its bare git directory (the search tool's `fetch
# github:EIFY/fairseq` leaves one at /work/.mirror/EIFY+fairseq/repo, the default). The fork is built
# once into .fairseq/ (git-ignored): commit 5d9ddfe7 in its own virtualenv (torch 2.13 CPU, numpy < 2,
# hydra-core 1.0.7, omegaconf 2.0.6), the two patches in benchmarks/fairseq/ (Python 3.11 rejects
# dataclass instances as field defaults: default_factory instead), and only its two Cython extensions,
# run from PYTHONPATH. Then benchmarks/vs_fairseq.py exports the main job's documents to the fork's
# binary format and runs both, interleaved, printing the table. Not part of the test suite.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${FAIRSEQ_WORK:-$ROOT/.fairseq}
COMMIT=5d9ddfe79cf42fc68aa75089babcef7aa1ade085
SNAPSHOT=/work/.mirror/EIFY+fairseq/repo
if [ $# -gt 0 ] && [ "$1" != "--" ]; then SNAPSHOT=$1; shift; fi
[ "${1:-}" = "--" ] && shift
GIT_DIR_OF_SNAPSHOT=$SNAPSHOT
[ -d "$SNAPSHOT/.git" ] && GIT_DIR_OF_SNAPSHOT=$SNAPSHOT/.git
PY=$WORK/venv/bin/python
mkdir -p "$WORK"

if [ ! -f "$WORK/venv/.ready" ]; then
    echo "== virtualenv for the fork: $WORK/venv"
    python3 -m venv "$WORK/venv"
    "$PY" -m pip install -q "torch==2.13.0" "numpy<2" "hydra-core==1.0.7" "omegaconf==2.0.6" \
        cython bitarray regex tqdm cffi sacrebleu
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    patch -d "$site" -p1 -s < "$ROOT/benchmarks/fairseq/hydra-1.0.7-py311.patch"
    touch "$WORK/venv/.ready"
fi

if [ ! -f "$WORK/src/.ready" ]; then
    echo "== the fork at $COMMIT from $SNAPSHOT: $WORK/src"
    if ! git --git-dir "$GIT_DIR_OF_SNAPSHOT" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
        echo "vs_fairseq.sh: $SNAPSHOT holds no commit $COMMIT of EIFY/fairseq; clone" \
             "https://github.com/EIFY/fairseq and pass its folder" >&2
        exit 2
    fi
    rm -rf "$WORK/src" && mkdir -p "$WORK/src"
    git --git-dir "$GIT_DIR_OF_SNAPSHOT" archive "$COMMIT" | tar -x -C "$WORK/src"
    patch -d "$WORK/src" -p1 -s < "$ROOT/benchmarks/fairseq/fork-py311.patch"
    (cd "$WORK/src" && "$PY" - <<'PYEOF'
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = [Extension(f"fairseq.data.{name}", [f"fairseq/data/{name}.pyx"], include_dirs=[numpy.get_include()],
                 language="c++") for name in ("data_utils_fast", "token_block_utils_fast")]
setup(name="fairseq-cython", script_args=["build_ext", "--inplace", "-q"],
      ext_modules=cythonize(ext, language_level=3, quiet=True))
PYEOF
    ) > "$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
    touch "$WORK/src/.ready"
fi

cd "$ROOT"
exec "${MEGAMLM_PYTHON:-$ROOT/.venv/bin/python}" benchmarks/vs_fairseq.py --fork-python "$PY" --fork-src "$WORK/src" \
    --work "$WORK" "$@"
