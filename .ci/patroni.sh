#!/usr/bin/env bash
# What the Patroni tests (tests/ha_patroni) and bench/ha.py's second part need:
#   * etcd, from Debian's etcd-server (apt-get, when /usr/bin/etcd is missing);
#   * Patroni (PyPI patroni[psycopg3,etcd3], 4.x) in a venv of /usr/bin/python3 at
#     $PGCOORD_PATRONI_VENV (default /opt/pgcoord-patroni).
# Patroni runs as the postgres user (PostgreSQL refuses root), so its venv must be
# somewhere that user can read and run: not in the CI clone (a root-owned home may
# not be traversable), not on a pyenv interpreter under /root. /opt is. The venv is
# reused when it already has Patroni 4; `--upgrade` makes it again.
# Usage: bash .ci/patroni.sh [--upgrade]
set -euo pipefail
venv=${PGCOORD_PATRONI_VENV:-/opt/pgcoord-patroni}
python=/usr/bin/python3

if ! command -v etcd >/dev/null && [ ! -x /usr/bin/etcd ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        # The package starts an etcd service on 2379; the tests start their own.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
        if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
            systemctl stop etcd || true
        fi
    else
        echo "patroni.sh: etcd is missing; install it (Debian: apt-get install etcd-server)" >&2
        exit 1
    fi
fi

if [ "${1:-}" = "--upgrade" ] || ! "$venv/bin/patroni" --version 2>/dev/null | grep -q '^patroni 4\.'; then
    if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        else
            echo "patroni.sh: $python cannot make a venv (Debian: apt-get install python3-venv)" >&2
            exit 1
        fi
    fi
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check 'patroni[psycopg3,etcd3]>=4.1,<5' 2>&1 \
        | grep -v -e '^WARNING: Location' -e 'DEPRECATION' -e 'pip 23.1 will enforce' -e 'issues/8559' >&2 || true
    chmod -R a+rX "$venv"
fi
"$venv/bin/patroni" --version
etcd_bin=$(command -v etcd || echo /usr/bin/etcd)
# (awk, not head: head leaves before etcd has written everything, and with pipefail
# the SIGPIPE that etcd then gets failed this script, now and then: exit 141.)
"$etcd_bin" --version | awk 'NR == 1'
