package xds

// HealthView tells the translator which endpoints the picker considers
// unhealthy, so they can be withheld from EDS (override_host does not check
// health itself). The picker implements it; xds never imports the picker.
type HealthView interface {
	// Unhealthy reports whether endpoint addr ("ip:port") of pool should be
	// withheld from Envoy.
	Unhealthy(pool, addr string) bool
	// Changed returns a channel that is closed once any answer of
	// Unhealthy may have changed. The server calls Changed before reading
	// Unhealthy, so no change is lost.
	Changed() <-chan struct{}
}
