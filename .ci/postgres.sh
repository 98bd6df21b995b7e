#!/usr/bin/env bash
# Start a throwaway PostgreSQL server (trust auth, 127.0.0.1 only, fsync=off) for the DB
# concurrency tests, installing Debian's postgresql first if needed; prints only its URL:
#   export TUNEGEN_TEST_PG_URL=$(bash .ci/postgres.sh)   # the stop command is logged on stderr
set -euo pipefail

pg_bindir() {  # newest Debian /usr/lib/postgresql/<major>/bin, else wherever initdb is on PATH
    local d
    d=$(shopt -s nullglob; printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n1)
    if [ -n "$d" ]; then echo "$d"; elif command -v initdb >/dev/null; then dirname "$(command -v initdb)"; fi
}

start_server() {
    bin=$(pg_bindir)
    if [ -z "$bin" ]; then
        echo "postgres.sh: installing postgresql from apt"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -qq update >/dev/null
        apt-get -qq install -y --no-install-recommends postgresql >/dev/null
        bin=$(pg_bindir)
    fi

    dir=$(mktemp -d "${TMPDIR:-/tmp}/tunegen-pg.XXXXXX")
    as=()
    if [ "$(id -u)" = 0 ]; then  # the server refuses to run as root
        chown postgres: "$dir"
        as=(runuser -u postgres --)
    fi

    port=54329  # first port nothing is listening on
    while (: <"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done

    "${as[@]}" "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
    printf 'local all all trust\nhost all all 127.0.0.1/32 trust\n' >"$dir/data/pg_hba.conf"
    cat >>"$dir/data/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
    "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start >/dev/null
    "${as[@]}" "$bin/createdb" -h "$dir" -p "$port" -U postgres tunegen_test
    echo "postgres.sh: PostgreSQL on 127.0.0.1:$port, data in $dir/data; stop with:"
    echo "  ${as[*]} $bin/pg_ctl -D $dir/data stop -m fast"
}

start_server >&2  # keep stdout for the URL alone
echo "postgresql+psycopg://postgres@127.0.0.1:$port/tunegen_test"
