# Stand-in for the official postgres:<major>-<debian> image, from Debian's PostgreSQL: the same data
# folder, port, POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB on first start, and pg_isready on PATH.
ARG DEBIAN=bookworm
FROM debian:${DEBIAN}-slim
ARG PG_MAJOR=15
RUN apt-get update \
    && apt-get install -y --no-install-recommends "postgresql-${PG_MAJOR}" \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/${PG_MAJOR}/bin:${PATH} \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
