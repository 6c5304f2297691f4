//! burn-metax-backend
