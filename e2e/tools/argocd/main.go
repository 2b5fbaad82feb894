// Argo CD's one binary, for the GitOps e2e tests and the Lua health/action checks.
//
// argo-cd's own cmd/main.go is a `package main` inside the argo-cd module and cannot be
// imported, so this wrapper repeats its dispatch for the three programs the tests run: the
// CLI (`argocd admin settings resource-overrides ...`), the application controller and the
// repo server. Like upstream, it acts by its own name or by $ARGOCD_BINARY_NAME.
package main

import (
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	appcontroller "github.com/argoproj/argo-cd/v3/cmd/argocd-application-controller/commands"
	cli "github.com/argoproj/argo-cd/v3/cmd/argocd/commands"
	reposerver "github.com/argoproj/argo-cd/v3/cmd/argocd-repo-server/commands"
	"github.com/argoproj/argo-cd/v3/util/log"
)

func init() {
	klog.SetLogger(log.NewLogrusLogger(log.NewWithCurrentConfig()))
}

func main() {
	name := filepath.Base(os.Args[0])
	if val := os.Getenv("ARGOCD_BINARY_NAME"); val != "" {
		name = val
	}
	var command *cobra.Command
	switch name {
	case "argocd-application-controller":
		command = appcontroller.NewCommand()
	case "argocd-repo-server":
		command = reposerver.NewCommand()
	default:
		command = cli.NewCommand()
	}
	if err := command.Execute(); err != nil {
		os.Exit(1)
	}
}
