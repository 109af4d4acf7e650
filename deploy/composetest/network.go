package composetest

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// FreeSubnet returns an IPv4 /24 inside within (e.g. 10.231.0.0/16) that
// overlaps no Docker network's subnet, no address or route of the host
// and none of avoid, chosen at random (concurrent tests rarely pick the
// same one; Compose refuses an overlapping network, and the caller may
// retry).
func (e *Engine) FreeSubnet(t testing.TB, within netip.Prefix, avoid ...netip.Prefix) netip.Prefix {
	t.Helper()
	used := append(e.dockerSubnets(t), hostPrefixes(t)...)
	used = append(used, avoid...)
	if within.Bits() > 24 || !within.Addr().Is4() {
		t.Fatalf("FreeSubnet: %s has no /24 inside", within)
	}
	n := 1 << (24 - within.Bits())
	base := within.Masked().Addr().As4()
	start := rand.IntN(n)
	for i := range n {
		k := (start + i) % n
		a := base
		v := binary.BigEndian.Uint32(a[:]) + uint32(k)<<8
		binary.BigEndian.PutUint32(a[:], v)
		cand := netip.PrefixFrom(netip.AddrFrom4(a), 24)
		free := true
		for _, u := range used {
			if u.Overlaps(cand) {
				free = false
				break
			}
		}
		if free {
			return cand
		}
	}
	t.Fatalf("FreeSubnet: every /24 of %s is in use", within)
	return netip.Prefix{}
}

// dockerSubnets lists the subnets of every Docker network.
func (e *Engine) dockerSubnets(t testing.TB) []netip.Prefix {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ids, err := e.Docker(ctx, "network", "ls", "-q")
	if err != nil {
		t.Fatalf("%v: %s", err, ids)
	}
	if strings.TrimSpace(ids) == "" {
		return nil
	}
	out, err := e.Docker(ctx, append([]string{"network", "inspect", "--format", "{{range .IPAM.Config}}{{.Subnet}} {{end}}"}, strings.Fields(ids)...)...)
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var subnets []netip.Prefix
	for _, f := range strings.Fields(out) {
		if p, err := netip.ParsePrefix(f); err == nil {
			subnets = append(subnets, p)
		}
	}
	return subnets
}

// hostPrefixes lists the host's interface networks and IPv4 routes.
func hostPrefixes(t testing.TB) []netip.Prefix {
	t.Helper()
	var out []netip.Prefix
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if p, err := netip.ParsePrefix(n.String()); err == nil {
				out = append(out, p.Masked())
			}
		}
	}
	// /proc/net/route: destination and mask in little-endian hex; the
	// default route (mask 0) is not a conflict.
	f, err := os.Open("/proc/net/route")
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || fields[0] == "Iface" {
			continue
		}
		dst, err1 := hex.DecodeString(fields[1])
		mask, err2 := hex.DecodeString(fields[7])
		if err1 != nil || err2 != nil || len(dst) != 4 || len(mask) != 4 {
			continue
		}
		bits, _ := net.IPv4Mask(mask[3], mask[2], mask[1], mask[0]).Size()
		if bits == 0 {
			continue
		}
		out = append(out, netip.PrefixFrom(netip.AddrFrom4([4]byte{dst[3], dst[2], dst[1], dst[0]}), bits).Masked())
	}
	return out
}

// Relocation moves IPv4 addresses from one subnet to another of the same
// size, keeping each address's host part: a stack written for 10.231.0.0/24
// runs on a free subnet with every static address, advertised address,
// certificate SAN and service registration moved alike.
type Relocation struct {
	From, To netip.Prefix
}

// Addr moves one address (addresses outside From are returned as they
// are).
func (r Relocation) Addr(a netip.Addr) netip.Addr {
	if !r.From.Contains(a) {
		return a
	}
	f, to, x := r.From.Masked().Addr().As4(), r.To.Masked().Addr().As4(), a.As4()
	host := binary.BigEndian.Uint32(x[:]) - binary.BigEndian.Uint32(f[:])
	var out [4]byte
	binary.BigEndian.PutUint32(out[:], binary.BigEndian.Uint32(to[:])+host)
	return netip.AddrFrom4(out)
}

// Prefix moves a prefix inside From (a subnet, an ip_range).
func (r Relocation) Prefix(p netip.Prefix) netip.Prefix {
	return netip.PrefixFrom(r.Addr(p.Addr()), p.Bits())
}

var ipv4Re = regexp.MustCompile(`\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(/\d{1,2})?\b`)

// String moves every IPv4 address (and prefix) of From found in s.
func (r Relocation) String(s string) string {
	return ipv4Re.ReplaceAllStringFunc(s, func(m string) string {
		if p, err := netip.ParsePrefix(m); err == nil && p.Addr().Is4() {
			return r.Prefix(p).String()
		}
		if a, err := netip.ParseAddr(m); err == nil && a.Is4() {
			return r.Addr(a).String()
		}
		return m
	})
}

// Mentions reports whether s contains an address of From.
func (r Relocation) Mentions(s string) bool {
	return r.String(s) != s
}

// CopyTree copies the directory or file src to dst with every file's text
// passed through edit (nil: unchanged). Directories are made 0755 and
// files 0644, whatever the umask and the source's modes: the copies are
// bind-mounted into containers that read them as other users.
func CopyTree(src, dst string, edit func(string) string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
			return os.Chmod(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("copy %s: not a regular file", p)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		text := string(b)
		if edit != nil {
			text = edit(text)
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(target, []byte(text), 0o644); err != nil {
			return err
		}
		return os.Chmod(target, 0o644)
	})
}
