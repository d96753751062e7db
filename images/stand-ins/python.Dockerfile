# Stand-in for the official python:<version>-slim-<debian> image, from Debian's own Python: the
# interpreter as `python`/`python3`, pip, venv, and no EXTERNALLY-MANAGED marker (the official image
# has none: `pip install` into it is how images are built).
ARG DEBIAN=bookworm
FROM debian:${DEBIAN}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python \
    && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8
CMD ["python3"]
