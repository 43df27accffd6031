#!/usr/bin/env bash
# Set up a fresh clone with everything (kvfsm[dev]: every extra, the Debian
# packages the tests use; idempotent, quick when nothing changed) and run a job:
#   ./dev.sh demo     the main job: kvfsm demo on the embedded default (docs/demo.md)
#   ./dev.sh test     lint, types and the test suite (what CI runs)
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

# ---- vLLM (the `vllm` tests: kvfsm's connectors inside vLLM's real scheduler; docs/vllm.md) ----
# vLLM 0.33.0 pins torch 2.14 (CUDA), so pip never resolves vllm itself: the wheel goes in with
# --no-deps beside kvfsm[vllm] (its import closure), all under the torch 2.13.0 (CPU) constraint.
# Its own stamp, so it runs once; KVFSM_NO_VLLM=1 skips it (the `vllm` tests then skip).
VLLM_VERSION=0.33.0
vllm_stamp="$VENV/.kvfsm-vllm"
vllm_want="$(printf '%s\n' "$VLLM_VERSION" "$(sed -n '/^vllm = \[/,/^\]/p' pyproject.toml)" | sha256sum | cut -d' ' -f1)"
if [ -z "${KVFSM_NO_VLLM:-}" ] && [ "$(cat "$vllm_stamp" 2>/dev/null)" != "$vllm_want" ]; then
    echo "==> installing vLLM $VLLM_VERSION without its torch pin (wheel 336 MB); log in $VENV/setup.log"
    t0=$SECONDS
    echo "torch==2.13.0" > "$VENV/torch-constraint.txt"
    pip_install -c "$VENV/torch-constraint.txt" -e ".[vllm]"
    pip_install --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"   # xgrammar's own deps would pull triton (~1 GB)
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, kvfsm.adapters.vllm_connector"
    echo "$vllm_want" > "$vllm_stamp"
    echo "    vLLM set up in $((SECONDS - t0)) s"
fi
export PATH="$PWD/$VENV/bin:$PATH"

case "${1:-demo}" in
    setup) ;;
    demo) kvfsm demo "${@:2}" ;;
    test)
        echo "==> ruff"; ruff check kvfsm tests benchmarks
        echo "==> mypy"; mypy
        echo "==> pytest"; pytest -q "${@:2}"
        ;;
    bench) kvfsm bench "${@:2}" ;;
    diagrams)
        for spec in specs/*.yaml specs/*/*.yaml; do
            grep -q '^system:' "$spec" && continue    # compositions: their roles are drawn
            name=$(sed -n 's/^machine: *\([A-Za-z0-9_]*\).*/\1/p' "$spec")    # drawn by machine name: unique
            kvfsm diagram "$spec" -f svg -o "docs/diagrams/$name.svg"
            kvfsm diagram "$spec" -f mermaid -o "docs/diagrams/$name.mmd"
        done
        ;;
    *) echo "usage: ./dev.sh [setup|demo|test|bench|diagrams]" >&2; exit 2 ;;
esac
