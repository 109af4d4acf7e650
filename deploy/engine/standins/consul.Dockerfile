# Stand-in for hashicorp/consul: the Consul the Makefile builds, with the
# official image's user (consul, uid 100), directories (/consul/data as a
# volume, /consul/config), ports and entrypoint behaviour (see
# consul-entrypoint.sh). Its health checks can use curl, as the official
# image's can.
ARG BASE
FROM ${BASE}
RUN groupadd --gid 1000 consul \
 && useradd --system --uid 100 --gid consul --home-dir /consul --no-create-home --shell /usr/sbin/nologin consul \
 && mkdir -p /consul/data /consul/config \
 && chown -R consul:consul /consul
COPY consul /bin/consul
COPY consul-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /consul/data
EXPOSE 8300 8301 8301/udp 8302 8302/udp 8500 8600 8600/udp
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["agent", "-dev", "-client", "0.0.0.0"]
