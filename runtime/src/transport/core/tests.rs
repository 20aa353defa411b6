//! Tests of the connection core on a fake clock.
