//! Who am I: rank, world size and master address from the launcher's environment variables.
//!
//! Recognised, in this order: torchrun/`tutti-run` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), Open MPI
//! (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`) and Slurm
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`). The store is `TUTTI_STORE`
//! (`tcp://host:port`, served by someone else such as `tutti-run`; `torch://host:port`, a
//! PyTorch `TCPStore`; or `file:///dir`); else torchrun's agent store when
//! `TORCHELASTIC_USE_AGENT_STORE=True` (at `MASTER_ADDR:MASTER_PORT`); else `MASTER_ADDR` +
//! `MASTER_PORT`, served by rank 0 — under srun without `MASTER_ADDR`, the step's first host
//! and a port from the job and step ids (`slurm.rs`).

use crate::error::{Error, Result};

/// Which launcher's variables were used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// torchrun or tutti-run (`RANK`, `WORLD_SIZE`).
    Torchrun,
    /// Open MPI's mpirun.
    OpenMpi,
    /// Slurm's srun.
    Slurm,
}

/// Where the rendezvous store is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreSpec {
    /// A TCP store served by rank 0 at host:port (`MASTER_ADDR`, `MASTER_PORT`).
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A TCP store served by someone else, such as `tutti-run` (`TUTTI_STORE=tcp://host:port`).
    Remote {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A file store in a shared directory.
    File(std::path::PathBuf),
    /// PyTorch's `TCPStore` served by someone else: torchrun's agent
    /// (`TORCHELASTIC_USE_AGENT_STORE=True` with `MASTER_ADDR`/`MASTER_PORT`) or
    /// `TUTTI_STORE=torch://host:port`.
    Torch {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

/// The launch environment of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank within this host.
    pub local_rank: usize,
    /// Which variables were found.
    pub launcher: Launcher,
    /// Rendezvous store.
    pub store: StoreSpec,
    /// The launcher's notice pipe (`TUTTI_LAUNCHER_FD`, set by `tutti-run`): where it reports
    /// ranks whose processes ended.
    pub launcher_fd: Option<i32>,
    /// torchrun's restart count (`TORCHELASTIC_RESTART_COUNT`), 0 elsewhere: each attempt
    /// rendezvouses under its own keys in the agent's store.
    pub restart: u64,
    /// `TUTTI_JOIN=1` (set by `tutti-run --elastic --max-restarts` for a replacement): this
    /// process joins a running job, taken in by its ranks' next `grow`, instead of starting
    /// one.
    pub join: bool,
}

fn parse_usize(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a non-negative integer")))
}

impl EnvInfo {
    /// Read the process environment.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable that is missing or malformed.
    pub fn from_env() -> Result<EnvInfo> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parse from any variable lookup (tests pass a map).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable that is missing or malformed.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EnvInfo> {
        let sets: [(Launcher, &str, &str, &str); 3] = [
            (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"),
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ];
        let Some((launcher, rk, wk, lk)) =
            sets.into_iter().find(|(_, r, w, _)| get(r).is_some() || get(w).is_some())
        else {
            return Err(Error::Config(
                "no rank information: set RANK and WORLD_SIZE (torchrun style, or start with \
                 tutti-run), or run under mpirun or srun"
                    .into(),
            ));
        };
        let need = |k: &str| get(k).ok_or_else(|| Error::Config(format!("{k} is not set")));
        let rank = parse_usize(rk, &need(rk)?)?;
        let world = parse_usize(wk, &need(wk)?)?;
        if world == 0 {
            return Err(Error::Config(format!("{wk}=0: a job needs at least one rank")));
        }
        if rank >= world {
            return Err(Error::Config(format!("{rk}={rank} is not below {wk}={world}")));
        }
        let local_rank = match get(lk) {
            Some(v) => parse_usize(lk, &v)?,
            None => 0,
        };
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"));
        let store = match get("TUTTI_STORE") {
            Some(s) => parse_store(&s)?,
            // Under srun with no MASTER_ADDR: the step's first host, a port from the job id.
            None if launcher == Launcher::Slurm && get("MASTER_ADDR").is_none() => {
                let list = get("SLURM_STEP_NODELIST")
                    .or_else(|| get("SLURM_JOB_NODELIST"))
                    .or_else(|| get("SLURM_NODELIST"))
                    .ok_or_else(|| {
                        Error::Config(
                            "under srun without MASTER_ADDR, tutti reads rank 0's host from \
                             SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, and neither is set"
                                .into(),
                        )
                    })?;
                let host = super::slurm::first_host(&list).ok_or_else(|| {
                    Error::Config(format!("cannot read a host from the Slurm node list {list:?}"))
                })?;
                let port = match get("MASTER_PORT") {
                    Some(p) => {
                        p.trim().parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                            Error::Config(format!("MASTER_PORT={p:?} is not a port (1-65535)"))
                        })?
                    }
                    None => super::slurm::port(
                        super::slurm::id(get("SLURM_JOB_ID").as_deref()),
                        super::slurm::id(get("SLURM_STEP_ID").as_deref()),
                    ),
                };
                StoreSpec::Tcp { host, port }
            }
            None => {
                let host = get("MASTER_ADDR").ok_or_else(|| {
                    Error::Config(
                        "MASTER_ADDR is not set: set MASTER_ADDR and MASTER_PORT to rank 0's \
                         host and a free port, or TUTTI_STORE=file:///shared/dir"
                            .into(),
                    )
                })?;
                let port_s = get("MASTER_PORT").ok_or_else(|| {
                    Error::Config("MASTER_PORT is not set (MASTER_ADDR is)".into())
                })?;
                let port =
                    port_s.trim().parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                        Error::Config(format!("MASTER_PORT={port_s:?} is not a port (1-65535)"))
                    })?;
                if host.trim().is_empty() {
                    return Err(Error::Config("MASTER_ADDR is empty".into()));
                }
                if agent_store {
                    // torchrun's agent already serves its TCPStore there: use it.
                    StoreSpec::Torch { host: host.trim().to_string(), port }
                } else {
                    StoreSpec::Tcp { host: host.trim().to_string(), port }
                }
            }
        };
        let launcher_fd = match get(super::launcher::LAUNCHER_FD) {
            Some(v) => {
                Some(v.trim().parse::<i32>().ok().filter(|fd| *fd >= 0).ok_or_else(|| {
                    Error::Config(format!(
                        "{}={v:?} is not a file descriptor number",
                        super::launcher::LAUNCHER_FD
                    ))
                })?)
            }
            None => None,
        };
        let restart = match get("TORCHELASTIC_RESTART_COUNT") {
            Some(v) => v.trim().parse::<u64>().map_err(|_| {
                Error::Config(format!("TORCHELASTIC_RESTART_COUNT={v:?} is not a whole number"))
            })?,
            None => 0,
        };
        let join = match get("TUTTI_JOIN").as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(v) => return Err(Error::Config(format!("TUTTI_JOIN={v:?}: use 1 or 0"))),
        };
        Ok(EnvInfo { rank, world, local_rank, launcher, store, launcher_fd, restart, join })
    }
}

fn parse_store(s: &str) -> Result<StoreSpec> {
    if let Some(path) = s.strip_prefix("file://") {
        if path.is_empty() {
            return Err(Error::Config("TUTTI_STORE=file:// needs a directory".into()));
        }
        return Ok(StoreSpec::File(path.into()));
    }
    if let Some(hp) = s.strip_prefix("torch://") {
        let (host, port) = host_port(s, hp)?;
        return Ok(StoreSpec::Torch { host, port });
    }
    if let Some(hp) = s.strip_prefix("tcp://") {
        let (host, port) = host_port(s, hp)?;
        return Ok(StoreSpec::Remote { host, port });
    }
    Err(Error::Config(format!(
        "TUTTI_STORE={s:?}: expected tcp://host:port, torch://host:port or file:///dir"
    )))
}

fn host_port(s: &str, hp: &str) -> Result<(String, u16)> {
    let (host, port) = hp
        .rsplit_once(':')
        .ok_or_else(|| Error::Config(format!("TUTTI_STORE={s:?} needs host:port")))?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| Error::Config(format!("TUTTI_STORE={s:?}: bad port")))?;
    Ok((host.trim_start_matches('[').trim_end_matches(']').to_string(), port))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<EnvInfo> {
        let m: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        EnvInfo::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank, e.launcher), (3, 8, 1, Launcher::Torchrun));
        assert_eq!(e.store, StoreSpec::Tcp { host: "10.0.0.1".into(), port: 29500 });
        assert_eq!(e.launcher_fd, None);
        let base = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let with_fd = |v: &'static str| {
            let mut vars = base.to_vec();
            vars.push(("TUTTI_LAUNCHER_FD", v));
            env(&vars)
        };
        assert_eq!(with_fd(" 7 ").unwrap().launcher_fd, Some(7));
        for bad in ["-1", "x", ""] {
            let e = with_fd(bad).unwrap_err().to_string();
            assert!(e.contains("TUTTI_LAUNCHER_FD"), "{bad}: {e}");
        }
    }

    #[test]
    fn openmpi_and_slurm() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("TUTTI_STORE", "file:///tmp/x"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world, e.launcher), (2, 4, Launcher::OpenMpi));
        assert_eq!(e.store, StoreSpec::File("/tmp/x".into()));
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("TUTTI_STORE", "tcp://[::1]:7000"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank, e.launcher), (5, 6, 1, Launcher::Slurm));
        assert_eq!(e.store, StoreSpec::Remote { host: "::1".into(), port: 7000 });
    }

    /// What `srun` puts in a task's environment (the variables and value forms of Slurm's
    /// documentation for srun and sbatch), for a few node lists: rank 0's host is the step's
    /// first node, the port comes from the job and step ids, and MASTER_ADDR/MASTER_PORT still
    /// win when set.
    #[test]
    fn srun_steps_without_master_addr() {
        let step = |nodelist: &'static str, job: &'static str, step: &'static str| {
            vec![
                ("SLURM_JOB_ID", job),
                ("SLURM_JOBID", job),
                ("SLURM_STEP_ID", step),
                ("SLURM_STEPID", step),
                ("SLURM_PROCID", "3"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_NODEID", "1"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_NPROCS", "8"),
                ("SLURM_NNODES", "4"),
                ("SLURM_TASKS_PER_NODE", "2(x4)"),
                ("SLURM_JOB_NODELIST", "gpu[001-004,010]"),
                ("SLURM_NODELIST", "gpu[001-004,010]"),
                ("SLURM_STEP_NODELIST", nodelist),
                ("SLURM_STEP_NUM_NODES", "4"),
                ("SLURM_STEP_NUM_TASKS", "8"),
                ("SLURMD_NODENAME", "gpu002"),
                ("SLURM_CLUSTER_NAME", "c1"),
            ]
        };
        for (nodelist, host) in [
            ("gpu[002-004,010]", "gpu002"),
            ("gpu010,gpu[001-002]", "gpu010"),
            ("rack[2-3]-n[07-08]", "rack2-n07"),
            ("gpu003", "gpu003"),
        ] {
            let e = env(&step(nodelist, "81234", "2")).unwrap();
            assert_eq!((e.rank, e.world, e.local_rank, e.launcher), (3, 8, 1, Launcher::Slurm));
            let port = super::super::slurm::port(81234, 2);
            assert_eq!(e.store, StoreSpec::Tcp { host: host.into(), port }, "{nodelist}");
        }
        // Two steps of one job: two ports.
        let a = env(&step("n1", "77", "0")).unwrap().store;
        let b = env(&step("n1", "77", "1")).unwrap().store;
        assert_ne!(a, b);
        // The batch step's name counts as step 0.
        let c = env(&step("n1", "77", "batch")).unwrap().store;
        assert_eq!(a, c);
        // Without a step node list, the job's.
        let mut v = step("x", "5", "0");
        v.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        assert_eq!(env(&v).unwrap().store, StoreSpec::Tcp { host: "gpu001".into(), port: 20_050 });
        // Set by hand, MASTER_ADDR and MASTER_PORT win.
        let mut v = step("n1", "5", "0");
        v.extend([("MASTER_ADDR", "10.1.1.1"), ("MASTER_PORT", "29500")]);
        assert_eq!(env(&v).unwrap().store, StoreSpec::Tcp { host: "10.1.1.1".into(), port: 29500 });
        // A malformed list is named.
        let e = env(&step("gpu[1-", "5", "0")).unwrap_err().to_string();
        assert!(e.contains("gpu[1-"), "{e}");
    }

    #[test]
    fn torchrun_agent_store_and_torch_urls() {
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "40217"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap();
        assert_eq!(e.store, StoreSpec::Torch { host: "localhost".into(), port: 40217 });
        assert_eq!(e.restart, 2);
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("TUTTI_STORE", "torch://h:5")]).unwrap();
        assert_eq!(e.store, StoreSpec::Torch { host: "h".into(), port: 5 });
    }

    #[test]
    fn torchrun_wins_over_slurm() {
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let msg = |r: Result<EnvInfo>| r.unwrap_err().to_string();
        assert!(msg(env(&[])).contains("RANK and WORLD_SIZE"));
        assert!(msg(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).contains("RANK=\"x\""));
        assert!(msg(env(&[("RANK", "0")])).contains("WORLD_SIZE is not set"));
        assert!(msg(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).contains("not below"));
        assert!(msg(env(&[("RANK", "0"), ("WORLD_SIZE", "0")])).contains("at least one"));
        assert!(msg(env(&[("RANK", "0"), ("WORLD_SIZE", "1")])).contains("MASTER_ADDR"));
        let m = msg(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ]));
        assert!(m.contains("MASTER_PORT=\"99999\""), "{m}");
        assert!(msg(env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("TUTTI_STORE", "redis://x")]))
            .contains("TUTTI_STORE"));
        assert!(msg(env(&[("SLURM_PROCID", "-1"), ("SLURM_NTASKS", "2")])).contains("SLURM_PROCID"));
    }
}
