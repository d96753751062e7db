#!/bin/sh
# The official image's contract, in short: initialise an empty PGDATA with POSTGRES_USER's password and
# POSTGRES_DB, listen on every address with password logins, then run the server as postgres.
set -eu
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" && chown -R postgres:postgres "$PGDATA" && chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" > "$pwfile"
    initdb --username="${POSTGRES_USER:-postgres}" --pwfile="$pwfile" --auth-host=scram-sha-256 \
        --auth-local=trust -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    db="${POSTGRES_DB:-${POSTGRES_USER:-postgres}}"
    if [ "$db" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username="${POSTGRES_USER:-postgres}" --dbname=postgres \
            -c "CREATE DATABASE \"$db\"" >/dev/null
    fi
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
if [ "${1:-}" = postgres ]; then
    shift
    exec postgres -c listen_addresses='*' "$@"
fi
exec "$@"
