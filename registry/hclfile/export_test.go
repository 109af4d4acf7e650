package hclfile

// Test hooks: methods only the package's own tests call.

// Loads returns how many loads have completed, good or bad.
func (s *Source) Loads() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loads
}
