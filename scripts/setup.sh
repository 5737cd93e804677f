#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for qosmq: RabbitMQ (Debian's package), Java for
# Spark, and a Python 3.11+ virtualenv with the layer and its test/dev/spark/mongo extras.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need_apt=()
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need_apt+=(rabbitmq-server)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
"$PY" - <<'PYCHECK'
import sys
if sys.version_info < (3, 11):
    raise SystemExit(f"qosmq needs Python >= 3.11, found {sys.version.split()[0]}")
PYCHECK
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.qosmq-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing qosmq and its extras into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test,dev,spark,mongo]"
  touch "$stamp"
fi
echo "setup: ready ($("$VENV/bin/python" --version), $(dpkg-query -W -f='rabbitmq-server ${Version}' rabbitmq-server 2>/dev/null || echo rabbitmq-server))"
