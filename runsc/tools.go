//go:build tools

// Package tools names the one package this module builds, so that `go mod tidy` keeps its requirements.
package tools

import _ "gvisor.dev/gvisor/runsc"
