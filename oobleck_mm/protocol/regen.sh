#!/usr/bin/env bash
# Regenerates oobleck_pb2.py / oobleck_pb2_grpc.py from oobleck.proto (needs grpcio-tools,
# in the project's `dev` extra). Run from anywhere: ./oobleck_mm/protocol/regen.sh [python]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${1:-${PYTHON:-python3}}"
# A relative interpreter path (.venv/bin/python) must survive the cd below.
[ -e "$python" ] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
cd "$here"
"$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. oobleck.proto
# protoc writes a top-level import; the modules live in a package.
sed -i.bak 's/^import oobleck_pb2 as oobleck__pb2$/from . import oobleck_pb2 as oobleck__pb2/' oobleck_pb2_grpc.py
rm -f oobleck_pb2_grpc.py.bak
grep -q '^from \. import oobleck_pb2' oobleck_pb2_grpc.py
