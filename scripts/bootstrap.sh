#!/usr/bin/env bash
# Sets up everything Waltz needs on a Debian 12 machine, idempotently:
#   - the Debian packages: zookeeper (and a Java runtime if none is installed);
#   - a virtual environment in .venv with Waltz and its test (and, with --spark, Spark) extras.
# Re-running it is cheap: each step is skipped when already done.
set -euo pipefail

cd "$(dirname "$0")/.."
EXTRAS="test"
for arg in "$@"; do
  case "$arg" in
    --spark) EXTRAS="test,spark" ;;
    *) echo "bootstrap: unknown option $arg" >&2; exit 2 ;;
  esac
done

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "bootstrap: need root to run: $*" >&2; exit 1; fi
}

java_major() {
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1
}

apt_packages=()
command -v java >/dev/null 2>&1 || apt_packages+=(default-jre-headless)
# Spark 4 needs Java 17 or later (Debian 12's default-jre-headless is 17).
if [ "$EXTRAS" = "test,spark" ] && command -v java >/dev/null 2>&1 && [ "$(java_major)" -lt 17 ] 2>/dev/null; then
  apt_packages+=(openjdk-17-jre-headless)
fi
[ -f /usr/share/java/zookeeper.jar ] || apt_packages+=(zookeeper)
PYTHON="${PYTHON:-python3}"
# Debian's own python3 creates virtual environments (with pip) only with its python3-venv package.
"$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 || apt_packages+=(python3-venv)
if [ ${#apt_packages[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${apt_packages[*]}"
  # (A freshly booted machine may still hold the package lock for its own upgrades: wait for it.)
  as_root apt-get -o DPkg::Lock::Timeout=300 update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

# A .venv whose creation failed half-way (no pip in it) is made again, not reused.
if ! { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; }; then
  echo "bootstrap: creating .venv"
  "$PYTHON" -m venv --clear .venv
fi

# Reinstall only when the package metadata or the requested extras changed.
stamp=".venv/.waltz-installed"
want="$(cat setup.cfg pyproject.toml constraints.txt | sha256sum | cut -c1-16)-$EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing Waltz and its [$EXTRAS] extras into .venv (log: .venv/install.log)"
  if ! {
    # The tested versions (constraints.txt), not whatever was released since.
    .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt --upgrade pip setuptools wheel &&
    # compat mode: the flat twisted/plugins layout stays visible to twistd (see docs/operations.md).
    .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e ".[$EXTRAS]" \
        --config-settings editable_mode=compat
  } > .venv/install.log 2>&1; then
    tail -n 30 .venv/install.log >&2
    echo "bootstrap: installing Python packages failed (full log: .venv/install.log)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
