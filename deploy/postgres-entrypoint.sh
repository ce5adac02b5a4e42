#!/usr/bin/env bash
# First start: create the cluster, the user and the database from POSTGRES_*. Every start: serve
# on all interfaces, with password (scram) auth for the network.
set -euo pipefail
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  # UTF8, as the official image makes it: a minimal base has no locales, and initdb would fall
  # back to SQL_ASCII, whose text drivers such as psycopg return as bytes
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -A scram-sha-256 \
    -E UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    # a server on the socket only, so no client sees the database before it exists
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    PGPASSWORD=$POSTGRES_PASSWORD createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
