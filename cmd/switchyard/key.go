package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/switchyard/switchyard/internal/apikey"
)

const keyUsage = `Usage:
  switchyard key new    create a random API key and print it with its hash
  switchyard key hash   read a key on standard input, print its hash

The key goes to the tenant; the hash ("sha256:...") goes into the tenant's
api_keys list or api_key_file. switchyard never stores the key itself.
`

// keyCmd creates API keys and hashes them (internal/apikey).
func keyCmd(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, keyUsage)
		return 2
	}
	fs := flag.NewFlagSet("key "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(fs.Output(), keyUsage) }
	switch args[0] {
	case "new":
		if code, done := parseFlags(fs, args[1:]); done {
			return code
		}
		key, hash, err := apikey.New()
		if err != nil {
			fmt.Fprintf(stderr, "key new: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "key:  %s\nhash: %s\n", key, hash)
		return 0
	case "hash":
		if code, done := parseFlags(fs, args[1:]); done {
			return code
		}
		line, err := bufio.NewReader(stdin).ReadString('\n')
		key := strings.TrimSpace(line)
		if key == "" {
			if err != nil && err != io.EOF {
				fmt.Fprintf(stderr, "key hash: reading standard input: %v\n", err)
			} else {
				fmt.Fprintln(stderr, "key hash: no key on standard input")
			}
			return 1
		}
		fmt.Fprintln(stdout, apikey.Hash(key))
		return 0
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, keyUsage)
		return 0
	default:
		fmt.Fprintf(stderr, "switchyard key: unknown subcommand %q\n\n%s", args[0], keyUsage)
		return 2
	}
}
