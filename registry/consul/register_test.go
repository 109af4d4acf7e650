package consul

import (
	"testing"
	"time"
)

// TestRegistrationReapedWhenCritical: a replica killed without
// deregistering must not stay in Consul, critical, forever (issue 26): its
// check asks the agent to remove it after DeregisterCriticalAfter, a
// duration Consul accepts (at least a minute).
func TestRegistrationReapedWhenCritical(t *testing.T) {
	t.Parallel()
	svc, err := Registration{Service: "switchyard", ID: "r1", Address: "10.0.0.1:9002", CheckURL: "http://10.0.0.1:9090/readyz"}.service()
	if err != nil {
		t.Fatal(err)
	}
	if svc.Check == nil {
		t.Fatal("no check")
	}
	d, err := time.ParseDuration(svc.Check.DeregisterCriticalServiceAfter)
	if err != nil || d < time.Minute || d > 10*time.Minute {
		t.Errorf("DeregisterCriticalServiceAfter = %q (%v), want between 1m (Consul's minimum) and 10m", svc.Check.DeregisterCriticalServiceAfter, err)
	}
}
