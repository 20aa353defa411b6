//! The golden cases G1 and G2 through `tutti-golden` under `tutti-run`: every rank a process,
//! TCP between them, the report printed by rank 0.

use std::process::Command;
use std::time::Duration;

use tutti_tests::run_with_deadline;

fn golden(case: &str, strategy: &str, np: usize, extra: &[&str]) -> (bool, String) {
    let case = format!("{}/../parallel/golden/{case}", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", &np.to_string(), "--", env!("CARGO_BIN_EXE_tt-golden")]);
    cmd.args(["--case", &case, "--strategy", strategy]).args(extra);
    let (out, killed) = run_with_deadline(cmd, Duration::from_secs(120));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!killed, "tutti-golden hung:\n{text}");
    (out.status.success(), text)
}

#[test]
fn g1_across_processes() {
    for (s, np, extra) in
        [("dp", 4, &[][..]), ("accum", 2, &["--micro-batches", "4"][..]), ("tp", 4, &[][..])]
    {
        let (ok, text) = golden("g1_linear_step.json", s, np, extra);
        assert!(ok, "{s} np{np}:\n{text}");
        assert!(
            text.contains(&format!("[0] # case linear_step  strategy {s}  world {np}")),
            "{text}"
        );
        assert!(text.contains("[0] PASS: 3 tensors within tolerance"), "{text}");
    }
}

#[test]
fn g2_across_processes_uneven_dp_and_tp() {
    for (s, np) in [("dp", 3), ("tp", 2)] {
        let (ok, text) = golden("g2_mlp_train.json", s, np, &[]);
        assert!(ok, "{s} np{np}:\n{text}");
        assert!(text.contains("[0] PASS: 4 tensors within tolerance"), "{text}");
    }
}

#[test]
fn g3_g4_g5_across_processes() {
    for (case, s, np, extra, n) in [
        ("g3_transformer_block.json", "tp", 4, &[][..], 15),
        ("g3_transformer_block.json", "tp-sp", 2, &[][..], 15),
        ("g3_transformer_block.json", "ulysses", 4, &[][..], 15),
        ("g4_tiny_lm.json", "vocab", 2, &[][..], 19),
        ("g4_tiny_lm.json", "tp-sp", 4, &[][..], 19),
        ("g5_pipeline_mlp.json", "pp", 4, &["--schedule", "1f1b"][..], 10),
        ("g5_pipeline_mlp.json", "pp", 2, &["--schedule", "gpipe"][..], 10),
    ] {
        let (ok, text) = golden(case, s, np, extra);
        assert!(ok, "{case} {s} np{np}:\n{text}");
        assert!(text.contains(&format!("[0] PASS: {n} tensors within tolerance")), "{text}");
    }
}

#[test]
fn indivisible_world_fails_with_the_reason() {
    let (ok, text) = golden("g2_mlp_train.json", "tp", 3, &[]);
    assert!(!ok);
    assert!(text.contains("must divide by the world size"), "{text}");
}
