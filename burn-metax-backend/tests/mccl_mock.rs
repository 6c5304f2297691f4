//! Tier-2 tests: the MCCL bindings (`libmccl.so` loader, error mapping, collectives) against the
//! mock, for a world of one rank (its collectives are then stream-ordered copies). Several ranks:
//! `collective_mock.rs`.

mod common;

use std::sync::Arc;

use burn_metax_backend::driver::{Driver, DriverError, MacaDriver, StreamHandle};
use burn_metax_backend::mccl::{
    MCCL_UNIQUE_ID_BYTES, MacaCommunicator, Mccl, McclDataType, McclError, McclRedOp, McclUniqueId,
};
use common::{Control, mock_root, mock_root_with_mccl};

fn mccl() -> Arc<Mccl> {
    Arc::new(Mccl::load_from(mock_root_with_mccl()).expect("load the mock MCCL"))
}

#[test]
fn loader_finds_libmccl_and_reports_its_absence() {
    let m = mccl();
    assert!(m.path().ends_with("lib/libmccl.so"));
    assert_eq!(m.version().map(|v| v.expect("version")), Some(21_803));
    assert!(MacaDriver::load_from(mock_root_with_mccl()).expect("driver").has_mccl());

    let err = Mccl::load_from(mock_root()).expect_err("no libmccl.so in the plain mock root");
    match &err {
        McclError::Load(DriverError::LibraryNotFound { path, .. }) => {
            assert!(path.ends_with("lib/libmccl.so"))
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("libmccl.so"), "{err}");
}

#[test]
fn communicator_of_one_rank() {
    let m = mccl();
    let id = m.unique_id().expect("id");
    assert_eq!(McclUniqueId::from_bytes(id.to_bytes()), id);
    assert_eq!(id.to_bytes().len(), MCCL_UNIQUE_ID_BYTES);
    let comm = MacaCommunicator::init_rank(m.clone(), 1, &id, 0).expect("init");
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    assert_eq!(comm.query().map(|q| q.expect("query")), Some((1, 0)));

    // Argument checks before MCCL is called.
    assert!(matches!(MacaCommunicator::init_rank(m.clone(), 1, &id, 1), Err(McclError::InvalidArgument(_))));
    // An id that MCCL rejects.
    let bogus = McclUniqueId::from_bytes([7; MCCL_UNIQUE_ID_BYTES]);
    let err = MacaCommunicator::init_rank(m.clone(), 1, &bogus, 0).expect_err("bogus id");
    assert_eq!(err.to_string(), "mcclCommInitRank failed: mcclInvalidArgument (4): invalid argument");
    // The id is taken by a world of one: joining it as a world of two is "invalid usage".
    let err = MacaCommunicator::init_rank(m, 2, &id, 0).expect_err("world of two");
    match err {
        McclError::Call { call, code, name, message } => {
            assert_eq!((call, code, name), ("mcclCommInitRank", 5, "mcclInvalidUsage"));
            assert_eq!(message, "invalid usage");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn error_codes_map_to_names_and_messages() {
    let m = mccl();
    let control = Control::open();
    let comm = MacaCommunicator::init_rank(m.clone(), 1, &m.unique_id().expect("id"), 0).expect("init");
    let d = MacaDriver::load_from(mock_root_with_mccl()).expect("driver");
    let buf = d.malloc(64).expect("malloc");
    let s = d.stream_create(true).expect("stream");

    control.inject("mcclAllReduce", 3, 0, 1);
    // SAFETY: `buf` holds 16 f32 and lives until the stream is synchronised below.
    let err = unsafe { comm.all_reduce(buf, buf, 16, McclDataType::Float32, McclRedOp::Sum, s) }
        .expect_err("injected");
    assert_eq!(err.to_string(), "mcclAllReduce failed: mcclInternalError (3): internal error");
    control.inject("mcclBroadcast", 42, 0, 1);
    // SAFETY: as above.
    let err = unsafe { comm.broadcast(buf, buf, 16, McclDataType::Float32, 0, s) }.expect_err("injected");
    assert_eq!(err.to_string(), "mcclBroadcast failed: mcclResult? (42): unknown result code");
    // SAFETY: as above; rejected before the call.
    let err = unsafe { comm.broadcast(buf, buf, 16, McclDataType::Float32, 1, s) }.expect_err("root 1 of 1");
    assert!(matches!(err, McclError::InvalidArgument(_)));
    control.inject("mcclGroupStart", 2, 0, 1);
    assert_eq!(
        m.group_start().expect_err("injected").to_string(),
        "mcclGroupStart failed: mcclSystemError (2): unhandled system error"
    );
    m.group_start().expect("group start");
    m.group_end().expect("group end");

    d.stream_synchronize(s).expect("sync");
    // SAFETY: allocated above; the stream is idle.
    unsafe { d.free(buf) }.expect("free");
    d.stream_destroy(s).expect("destroy");
}

#[test]
fn collectives_of_one_rank_are_stream_ordered_copies() {
    let m = mccl();
    let control = Control::open();
    let comm = MacaCommunicator::init_rank(m.clone(), 1, &m.unique_id().expect("id"), 0).expect("init");
    let d = MacaDriver::load_from(mock_root_with_mccl()).expect("driver");
    let s = d.stream_create(true).expect("stream");
    let values: Vec<f32> = (0..256).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let send = d.malloc(bytes.len()).expect("malloc");
    // SAFETY: `send` holds `bytes.len()` bytes.
    unsafe { d.memcpy_htod(send, &bytes) }.expect("upload");

    type Collective = fn(&MacaCommunicator, &MacaDriver, StreamArgs) -> Result<(), McclError>;
    struct StreamArgs(
        burn_metax_backend::driver::DevicePtr,
        burn_metax_backend::driver::DevicePtr,
        usize,
        burn_metax_backend::driver::StreamHandle,
    );
    let collectives: [(&str, Collective); 4] = [
        // SAFETY (all four): both buffers hold `n` f32 and live until the stream is synchronised.
        ("all_reduce", |c, _, StreamArgs(a, b, n, s)| unsafe {
            c.all_reduce(a, b, n, McclDataType::Float32, McclRedOp::Sum, s)
        }),
        ("all_gather", |c, _, StreamArgs(a, b, n, s)| unsafe {
            c.all_gather(a, b, n, McclDataType::Float32, s)
        }),
        ("reduce_scatter", |c, _, StreamArgs(a, b, n, s)| unsafe {
            c.reduce_scatter(a, b, n, McclDataType::Float32, McclRedOp::Max, s)
        }),
        ("broadcast", |c, _, StreamArgs(a, b, n, s)| unsafe {
            c.broadcast(a, b, n, McclDataType::Float32, 0, s)
        }),
    ];
    for (name, collective) in collectives {
        let recv = d.malloc(bytes.len()).expect("malloc");
        collective(&comm, &d, StreamArgs(send, recv, values.len(), s))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(control.pending_ops(s.as_raw()) > 0, "{name}: queued on the stream, not run yet");
        let mut out = vec![0u8; bytes.len()];
        // SAFETY: `out` outlives the copy (the stream is synchronised before it is read).
        unsafe { d.memcpy_dtoh_async(out.as_mut_ptr(), recv, out.len(), s) }.expect("download");
        d.stream_synchronize(s).expect("sync");
        assert_eq!(out, bytes, "{name}: a world of one copies send to recv");
        // SAFETY: the stream is idle.
        unsafe { d.free(recv) }.expect("free");
    }
    // SAFETY: the stream is idle.
    unsafe { d.free(send) }.expect("free");
    d.stream_destroy(s).expect("destroy");
}

#[test]
fn an_aborted_communicator_refuses_collectives() {
    let m = mccl();
    assert!(m.has_abort(), "the mock exports mcclCommAbort");
    let id = m.unique_id().expect("id");
    let mut comm = MacaCommunicator::from_unique_id(m.clone(), id.to_bytes(), 0, 1).expect("init");
    let d = MacaDriver::load_from(mock_root_with_mccl()).expect("driver");
    let buf = d.malloc(16).expect("malloc");
    comm.abort().expect("abort");
    comm.abort().expect("aborting twice is a no-op");
    assert!(comm.is_aborted());
    // SAFETY: `buf` holds 4 f32; nothing is queued (the call is refused).
    let err =
        unsafe { comm.all_reduce(buf, buf, 4, McclDataType::Float32, McclRedOp::Sum, StreamHandle::DEFAULT) }
            .expect_err("aborted");
    assert!(matches!(err, McclError::InvalidArgument(_)), "{err}");
    assert!(matches!(comm.query(), Some(Err(McclError::InvalidArgument(_)))));
    drop(comm);
    // SAFETY: nothing uses `buf`.
    unsafe { d.free(buf) }.expect("free");
}
