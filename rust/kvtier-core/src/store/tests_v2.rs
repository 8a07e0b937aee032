//! Page store v2 tests.
