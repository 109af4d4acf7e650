package composetest

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/compose-spec/compose-go/v2/types"
)

// Move says how a test moves a compose project off the addresses and host
// ports it was written for, so that it runs next to anything else on the
// host (another checkout's stack, the user's own).
type Move struct {
	// Reloc moves every address of the project's networks (static
	// addresses, subnets, addresses in commands, environment values and
	// bind-mounted files).
	Reloc Relocation
	// Dir receives rewritten copies of the bind-mounted files that name
	// an address of Reloc.From.
	Dir string
	// Mounts replaces bind-mount sources (absolute host paths) outright,
	// e.g. certificates the test generates for the moved addresses.
	Mounts map[string]string
	// HostPort returns the host port for a published container port; every
	// published port is published on 127.0.0.1 only.
	HostPort func(service string, target uint32) int
}

// Moved is an override file for a project, and where its ports went.
type Moved struct {
	// Override is the compose file to apply after the project's own.
	Override string
	// Ports maps service -> container port -> host port on 127.0.0.1.
	Ports map[string]map[uint32]int
}

// Override writes the override that applies m to p (a project loaded with
// resolved paths).
func Override(p *types.Project, m Move) (Moved, error) {
	var out strings.Builder
	moved := Moved{Ports: map[string]map[uint32]int{}}
	q := quote

	var nets []string
	for name := range p.Networks {
		nets = append(nets, name)
	}
	sort.Strings(nets)
	wroteNetworks := false
	for _, name := range nets {
		n := p.Networks[name]
		var pools []string
		for _, pool := range n.Ipam.Config {
			s, err := netip.ParsePrefix(pool.Subnet)
			if err != nil || !m.Reloc.From.Overlaps(s) {
				continue
			}
			line := "subnet: " + q(m.Reloc.String(pool.Subnet))
			if pool.IPRange != "" {
				line += ", ip_range: " + q(m.Reloc.String(pool.IPRange))
			}
			if pool.Gateway != "" {
				line += ", gateway: " + q(m.Reloc.String(pool.Gateway))
			}
			pools = append(pools, "        - {"+line+"}\n")
		}
		if len(pools) == 0 {
			continue
		}
		if !wroteNetworks {
			out.WriteString("networks:\n")
			wroteNetworks = true
		}
		fmt.Fprintf(&out, "  %s:\n    ipam:\n      config: !override\n%s", name, strings.Join(pools, ""))
	}

	out.WriteString("services:\n")
	copies := map[string]string{}
	for _, name := range sortedServices(p) {
		s := p.Services[name]
		var b strings.Builder // this service's lines
		var netNames []string
		for n, cfg := range s.Networks {
			if cfg != nil && cfg.Ipv4Address != "" {
				netNames = append(netNames, n)
			}
		}
		sort.Strings(netNames)
		if len(netNames) > 0 {
			b.WriteString("    networks:\n")
			for _, n := range netNames {
				fmt.Fprintf(&b, "      %s: {ipv4_address: %s}\n", n, q(m.Reloc.String(s.Networks[n].Ipv4Address)))
			}
		}
		if mentionsAny(m.Reloc, s.Command) {
			fmt.Fprintf(&b, "    command: !override %s\n", quoteList(m.Reloc, s.Command))
		}
		if mentionsAny(m.Reloc, s.Entrypoint) {
			fmt.Fprintf(&b, "    entrypoint: !override %s\n", quoteList(m.Reloc, s.Entrypoint))
		}
		if s.HealthCheck != nil && mentionsAny(m.Reloc, s.HealthCheck.Test) {
			return Moved{}, fmt.Errorf("service %s: its health check names an address to move; not supported", name)
		}
		var env []string
		for k, v := range s.Environment {
			if v != nil && m.Reloc.Mentions(*v) {
				env = append(env, fmt.Sprintf("      %s: %s\n", k, q(m.Reloc.String(*v))))
			}
		}
		sort.Strings(env)
		if len(env) > 0 {
			b.WriteString("    environment:\n" + strings.Join(env, ""))
		}
		if len(s.Ports) > 0 {
			ports := map[uint32]int{}
			var list []string
			for _, pc := range s.Ports {
				hp := m.HostPort(name, pc.Target)
				ports[pc.Target] = hp
				proto := pc.Protocol
				if proto == "" {
					proto = "tcp"
				}
				list = append(list, q(fmt.Sprintf("127.0.0.1:%d:%d/%s", hp, pc.Target, proto)))
			}
			moved.Ports[name] = ports
			fmt.Fprintf(&b, "    ports: !override [%s]\n", strings.Join(list, ", "))
		}
		var vols []string
		changed := false
		for _, v := range s.Volumes {
			src := v.Source
			if v.Type == types.VolumeTypeBind {
				if r, ok := m.Mounts[src]; ok {
					src, changed = r, true
				} else if c, err := rewrittenCopy(m, src, copies); err != nil {
					return Moved{}, fmt.Errorf("service %s: %w", name, err)
				} else if c != "" {
					src, changed = c, true
				}
			}
			spec := src + ":" + v.Target
			if v.ReadOnly {
				spec += ":ro"
			}
			vols = append(vols, q(spec))
		}
		if changed {
			fmt.Fprintf(&b, "    volumes: !override [%s]\n", strings.Join(vols, ", "))
		}
		if b.Len() > 0 {
			fmt.Fprintf(&out, "  %s:\n%s", name, b.String())
		}
	}
	moved.Override = out.String()
	return moved, nil
}

// rewrittenCopy returns a copy of the bind source src with Reloc applied
// to its files, or "" when none of them names an address to move. Copies
// are made once per source.
func rewrittenCopy(m Move, src string, copies map[string]string) (string, error) {
	if c, ok := copies[src]; ok {
		return c, nil
	}
	mentions := false
	err := filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		mentions = mentions || m.Reloc.Mentions(string(b))
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("bind mount %s: %w", src, err)
	}
	if !mentions {
		copies[src] = ""
		return "", nil
	}
	dst := filepath.Join(m.Dir, fmt.Sprintf("mount%d-%s", len(copies), filepath.Base(src)))
	if err := CopyTree(src, dst, m.Reloc.String); err != nil {
		return "", err
	}
	copies[src] = dst
	return dst, nil
}

func mentionsAny(r Relocation, args []string) bool {
	for _, a := range args {
		if r.Mentions(a) {
			return true
		}
	}
	return false
}

func quoteList(r Relocation, args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = quote(r.String(a))
	}
	return "[" + strings.Join(out, ", ") + "]"
}

// quote writes s as a YAML double-quoted string that Compose's
// interpolation leaves as it is ($ doubled).
func quote(s string) string {
	return strconv.Quote(strings.ReplaceAll(s, "$", "$$"))
}

func sortedServices(p *types.Project) []string {
	var names []string
	for n := range p.Services {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
