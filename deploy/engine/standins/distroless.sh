# Run by sh inside the Debian stand-in (standins.sh): writes to stdout the
# tarball of a distroless-style static root, the stand-in for
# gcr.io/distroless/static-debian12:nonroot: users and groups (nonroot is
# 65532), CA certificates, time zones and /tmp, and nothing to run.
set -e
out=$(mktemp -d)
mkdir -p "$out/etc/ssl/certs" "$out/usr/share" "$out/tmp" "$out/home/nonroot" "$out/root"
printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
	'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
	'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$out/etc/passwd"
printf '%s\n' 'root:x:0:' 'nobody:x:65534:' 'tty:x:5:' 'staff:x:50:' 'nonroot:x:65532:' >"$out/etc/group"
printf 'hosts: files dns\n' >"$out/etc/nsswitch.conf"
printf '%s\n' 'PRETTY_NAME="Distroless (switchyard stand-in)"' 'ID=debian' 'VERSION_ID="12"' >"$out/etc/os-release"
cp /etc/ssl/certs/ca-certificates.crt "$out/etc/ssl/certs/"
cp -a /usr/share/zoneinfo "$out/usr/share/"
chmod 1777 "$out/tmp"
chmod 700 "$out/root" "$out/home/nonroot"
chown 65532:65532 "$out/home/nonroot"
tar -C "$out" --numeric-owner -cf - .
