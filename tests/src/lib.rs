//! Integration tests
