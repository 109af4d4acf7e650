# Stand-in for the official golang image: the host's Go toolchain (the build
# context is its GOROOT) on the Debian stand-in, with the official image's
# layout: GOROOT /usr/local/go, GOPATH /go, both on PATH. Like the official
# image it trusts Debian's CA bundle only; a build behind an intercepting
# proxy adds its CA through the build secret described in docs/deployment.md.
ARG BASE
FROM ${BASE}
ARG GO_VERSION
ENV GOLANG_VERSION=${GO_VERSION} \
    GOTOOLCHAIN=local \
    GOPATH=/go \
    PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY . /usr/local/go
RUN mkdir -p /go/src /go/bin && chmod -R 1777 /go
WORKDIR /go
