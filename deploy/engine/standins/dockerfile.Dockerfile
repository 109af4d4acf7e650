# Stand-in for docker/dockerfile:1, the BuildKit frontend that
# `# syntax=docker/dockerfile:1` names: BuildKit's dockerfile-frontend,
# built in Compose's module graph (build-compose.sh). BuildKit runs it as a
# gateway frontend without network.
FROM scratch
COPY dockerfile-frontend /bin/dockerfile-frontend
LABEL moby.buildkit.frontend.network.none="true" \
      moby.buildkit.frontend.caps="moby.buildkit.frontend.inputs,moby.buildkit.frontend.subrequests,moby.buildkit.frontend.contexts"
ENTRYPOINT ["/bin/dockerfile-frontend"]
