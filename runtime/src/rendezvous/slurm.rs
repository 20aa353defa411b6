//! Rank 0's address under `srun` when nobody set `MASTER_ADDR`: the first host of the step's
//! node list, and a port derived from the job and step ids.
//!
//! Slurm writes node lists compressed: `node[01-04,07]`, `a1,b[2-3]`, `rack[1-2]-gpu[01-02]`
//! (brackets multiply out, leading zeros are kept). Rank 0 runs on the first node of the step
//! (Slurm's block and cyclic distributions both start there), so only the first host is needed;
//! it is read in Rust, without `scontrol`.
//!
//! The port: `20000 + (SLURM_JOB_ID mod 4000) × 10 + (SLURM_STEP_ID mod 10)`, within 20000–59999,
//! so two jobs whose ids differ by less than 4000 never meet, and up to ten steps of one job
//! running at once each get their own (Lightning's rule, `10000 + the job id's last four
//! digits`, gives every step of a job the same port).

/// The first host of a compressed Slurm node list; `None` when the list is empty or malformed.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first item: up to the first comma outside brackets.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return None;
        }
    }
    let item = &list[..end];
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        let inside = &rest[open + 1..close];
        // The first range's first value, as written (leading zeros kept).
        let first = inside.split(',').next()?.split('-').next()?.trim();
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

/// The store port for job `job` and step `step` (see the module docs).
pub fn port(job: u64, step: u64) -> u16 {
    (20_000 + (job % 4000) * 10 + step % 10) as u16
}

/// A Slurm id as a number: `SLURM_STEP_ID` may also be a name (`batch`, `extern`) or the
/// placeholder 4294967294; those count as 0.
pub fn id(v: Option<&str>) -> u64 {
    v.and_then(|s| s.trim().parse::<u64>().ok()).filter(|n| *n < 0xFFFF_FFF0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_as_slurm_writes_them() {
        for (list, first) in [
            ("node01", "node01"),
            ("node[01-04,07]", "node01"),
            ("node[07,01-04]", "node07"),
            ("a1,b[2-3]", "a1"),
            ("gpu-[002-010]-ib", "gpu-002-ib"),
            ("rack[1-2]-gpu[01-02]", "rack1-gpu01"),
            ("c[5]", "c5"),
            ("10.0.0.1,10.0.0.2", "10.0.0.1"),
            ("  node[3-4] ", "node3"),
            ("localhost", "localhost"),
        ] {
            assert_eq!(first_host(list).as_deref(), Some(first), "{list}");
        }
        for bad in ["", "node[", "node[]", "node[a-b]", "node]1", "n[[1]]"] {
            assert_eq!(first_host(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ports_separate_jobs_and_steps() {
        assert_eq!(port(1234, 0), 32_340);
        assert_eq!(port(1234, 1), 32_341);
        assert_ne!(port(1234, 0), port(1235, 0));
        assert_eq!(port(4000, 0), 20_000);
        assert!((20_000..60_000).contains(&port(u64::MAX, u64::MAX)));
        assert_eq!(id(Some("17")), 17);
        assert_eq!(id(Some("batch")), 0);
        assert_eq!(id(Some("4294967294")), 0);
        assert_eq!(id(None), 0);
    }
}
