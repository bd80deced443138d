#!/usr/bin/env bash
# Installs the MindtPy chain used by `solver: mindtpy` (the seed's eq. 2.6):
# Ipopt and the AMPL solver library from Debian, cyipopt + scipy from PyPI,
# and Pyomo's PyNumero extension built against the system ASL.
# Usage: scripts/install_minlp.sh [PYTHON]   (default: .venv/bin/python)
# Idempotent: every step is skipped when its result is already there.
set -euo pipefail
PY=${1:-.venv/bin/python}

need_apt=()
for pkg in coinor-libipopt-dev libamplsolver-dev liblapack-dev libblas-dev pkg-config cmake; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install_minlp: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi

"$PY" -c "import cyipopt, scipy" 2>/dev/null || {
  echo "install_minlp: pip install cyipopt scipy"
  "$PY" -m pip install -q cyipopt scipy
}

"$PY" - <<'PYEOF'
from pyomo.contrib.pynumero.asl import AmplInterface
if AmplInterface.available():
    print("install_minlp: PyNumero ASL interface already built")
else:
    print("install_minlp: building PyNumero against the system ASL")
    from pyomo.contrib.pynumero.build import build_pynumero
    build_pynumero(user_args=[
        "-DASL_INCLUDE_DIR=/usr/include/ampl-netlib-solvers",
        "-DASL_LIBRARY=/usr/lib/x86_64-linux-gnu/libamplsolver.so",
        "-DBUILD_AMPLASL_IF_NEEDED=OFF",
    ])
PYEOF
"$PY" -c "
from pyomo.contrib.pynumero.asl import AmplInterface
import cyipopt
assert AmplInterface.available(), 'PyNumero ASL interface did not build'
print('install_minlp: MindtPy chain ready (cyipopt', cyipopt.__version__, ')')
"
