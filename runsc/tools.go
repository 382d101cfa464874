//go:build tools

// Package tools names the gVisor package this module builds (runsc; ./seccompgen is the other, run before it),
// so that `go mod tidy` keeps its requirements.
package tools

import _ "gvisor.dev/gvisor/runsc"
