//! The tests that count memory: live and peak bytes and large allocations, read from a
//! counting global allocator (`tests::alloc`). Its counters are process-wide, so these tests
//! have a binary of their own and run one at a time (each holds `tests::alloc::exclusive()`).
//!
//! Run one file's tests with a filter: `cargo test -p tests --test memory fsdp_memory::`.

#[global_allocator]
static ALLOCATOR: tests::alloc::Counting = tests::alloc::Counting;

mod fsdp_memory;
mod fuzz_parsers;
mod plan_memory;
mod qwen3_06b_memory;
