//! The PyTorch golden cases G1 (linear_step) and G2 (mlp_train) through the golden runner, for
//! every strategy at every world size the case lists, ranks as threads over the in-memory
//! transport. (tests/tests/golden_processes.rs runs them across processes over TCP.)

use std::path::PathBuf;

use tutti_parallel::golden::{run_threads, Case, Options, Strategy};

fn case(name: &str) -> Case {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden").join(name);
    Case::load(&p).unwrap()
}

fn worlds(c: &Case, key: Option<&str>) -> Vec<usize> {
    let w = &c.meta["world_sizes"];
    let w = match key {
        Some(k) => &w[k],
        None => w,
    };
    w.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect()
}

fn pass(c: &Case, s: Strategy, n: usize, opts: &Options) {
    let r = run_threads(c, s, n, opts).unwrap();
    assert!(r.ok(), "{r}");
    assert_eq!(r.world, n);
}

#[test]
fn g1_linear_step_dp_accum_tp() {
    let c = case("g1_linear_step.json");
    for n in worlds(&c, None) {
        pass(&c, Strategy::Dp, n, &Options::default());
        pass(&c, Strategy::Tp, n, &Options::default());
        // The README checks m = each world size micro-batches.
        for m in [1, 2, 4, 8] {
            pass(&c, Strategy::Accum, n, &Options { micro_batches: m, ..Options::default() });
        }
    }
}

#[test]
fn g2_mlp_train_dp_uneven_and_tp() {
    let c = case("g2_mlp_train.json");
    for n in worlds(&c, Some("data_parallel")) {
        pass(&c, Strategy::Dp, n, &Options::default());
    }
    pass(&c, Strategy::Accum, 3, &Options { micro_batches: 3, ..Options::default() });
    for n in worlds(&c, Some("tensor_parallel")) {
        pass(&c, Strategy::Tp, n, &Options::default());
    }
}

#[test]
fn a_world_that_does_not_divide_is_refused_up_front() {
    let c = case("g2_mlp_train.json");
    let e = run_threads(&c, Strategy::Tp, 3, &Options::default()).unwrap_err().to_string();
    assert!(e.contains("must divide by the world size"), "{e}");
}

#[test]
fn a_wrong_answer_fails() {
    // Corrupt one reference value: the runner must say FAIL for that tensor.
    let mut c = case("g1_linear_step.json");
    let w1 = c.tensors["w1"].clone();
    let bumped =
        w1.broadcast_add(&candle_core::Tensor::new(1e-3f32, w1.device()).unwrap()).unwrap();
    c.tensors.insert("w1".into(), bumped);
    let r = run_threads(&c, Strategy::Dp, 2, &Options::default()).unwrap();
    assert!(!r.ok());
    let bad: Vec<&str> = r.checks.iter().filter(|k| !k.ok()).map(|k| k.name.as_str()).collect();
    assert_eq!(bad, ["w1"]);
}

#[test]
fn g3_transformer_block_tp_tpsp_ulysses() {
    let c = case("g3_transformer_block.json");
    for n in worlds(&c, Some("tensor_parallel")) {
        pass(&c, Strategy::Tp, n, &Options::default());
        pass(&c, Strategy::TpSp, n, &Options::default());
    }
    for n in worlds(&c, Some("ulysses_sequence_parallel")) {
        pass(&c, Strategy::Ulysses, n, &Options::default());
    }
}

#[test]
fn g4_tiny_lm_vocab_parallel_with_and_without_sp() {
    let c = case("g4_tiny_lm.json");
    for n in worlds(&c, Some("tensor_parallel_and_vocab_parallel")) {
        pass(&c, Strategy::Vocab, n, &Options::default());
        pass(&c, Strategy::TpSp, n, &Options::default());
    }
}

#[test]
fn g5_pipeline_both_schedules() {
    let c = case("g5_pipeline_mlp.json");
    for n in worlds(&c, Some("pipeline_stages")) {
        for schedule in [tutti_parallel::Schedule::GPipe, tutti_parallel::Schedule::OneFOneB] {
            pass(&c, Strategy::Pp, n, &Options { schedule, ..Options::default() });
        }
    }
    // Other micro-batch counts (the loss scaling keeps the sum equal) and an uneven 3-stage split.
    for m in [1, 2, 8] {
        pass(&c, Strategy::Pp, 3, &Options { pp_micro_batches: Some(m), ..Options::default() });
    }
}
