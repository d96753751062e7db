# Stand-in for the official redis:<version>-<debian> image, from Debian's Redis: reachable from other
# containers (no protected mode, every address), redis-cli on PATH.
ARG DEBIAN=bookworm
FROM debian:${DEBIAN}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no", "--bind", "0.0.0.0", "--save", "", "--appendonly", "no"]
