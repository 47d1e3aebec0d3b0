//! Who launched this process: alone, or as one rank of an MPI job.
//!
//! MPI launchers (`mpirun`, `mpiexec`, `srun`) tell each process its place through the
//! environment; reading it first means a process started alone never initialises MPI, and a
//! process started as a rank by a build without MPI says so instead of training alone.

use std::time::Duration;

use super::{DistError, Group};

/// This process's place as the launcher gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank.
    pub rank: usize,
    /// The ranks the launcher started.
    pub ranks: usize,
}

/// Environment variables launchers set: Open MPI's, then the PMI ones MPICH and Slurm set.
const SIZE_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];
const RANK_VARS: [&str; 3] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"];

/// Launcher variables for a rank's place among the ranks on its own host: Open MPI's, MPICH's,
/// Slurm's and PMIx's.
const LOCAL_RANK_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "PMIX_LOCAL_RANK",
];

/// This process's rank among the ranks on its host (which GPU it takes), as `var` says; 0
/// when no launcher says (started alone, or a launcher that does not tell).
pub fn local_rank(var: impl Fn(&str) -> Option<String>) -> usize {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|&n| var(n)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The launch `var` describes (`std::env::var` in a run; a map in tests). `None`: started alone.
pub fn launched(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>, DistError> {
    let first = |names: &[&'static str]| names.iter().find_map(|&n| var(n).map(|v| (n, v)));
    let Some((size_name, size)) = first(&SIZE_VARS) else {
        return Ok(None);
    };
    let parse = |name: &str, v: &str| {
        v.trim().parse::<usize>().map_err(|_| {
            DistError::Launch(format!(
                "{name}={v:?} from the MPI launcher is not a number"
            ))
        })
    };
    let ranks = parse(size_name, &size)?;
    let rank = match first(&RANK_VARS) {
        Some((name, v)) => parse(name, &v)?,
        None => 0,
    };
    Ok((ranks > 1).then_some(Launch { rank, ranks }))
}

/// The group this process belongs to: alone unless an MPI launcher started it as one of
/// several ranks. `timeout` bounds every collective (the watchdog).
pub fn from_env(timeout: Duration) -> Result<Group, DistError> {
    let Some(launch) = launched(|n| std::env::var(n).ok())? else {
        return Ok(Group::solo());
    };
    join(launch, timeout)
}

#[cfg(feature = "mpi")]
fn join(launch: Launch, timeout: Duration) -> Result<Group, DistError> {
    use super::Transport;
    let transport = super::mpi::Mpi::init()?;
    if (transport.rank(), transport.ranks()) != (launch.rank, launch.ranks) {
        return Err(DistError::Launch(format!(
            "the launcher said rank {} of {}, MPI says rank {} of {}: is this gaccwb linked \
             against the MPI library whose launcher started it?",
            launch.rank,
            launch.ranks,
            transport.rank(),
            transport.ranks()
        )));
    }
    Ok(Group::new(Box::new(transport), Some(timeout)))
}

#[cfg(not(feature = "mpi"))]
fn join(launch: Launch, _timeout: Duration) -> Result<Group, DistError> {
    Err(DistError::NotBuiltWithMpi {
        rank: launch.rank,
        ranks: launch.ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn alone_without_launcher_variables_or_with_one_rank() {
        assert_eq!(launched(env(&[])).unwrap(), None);
        assert_eq!(
            launched(env(&[("OMPI_COMM_WORLD_SIZE", "1")])).unwrap(),
            None
        );
    }

    #[test]
    fn open_mpi_and_pmi_variables_give_the_rank() {
        let open_mpi = env(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "3")]);
        assert_eq!(
            launched(open_mpi).unwrap(),
            Some(Launch { rank: 3, ranks: 4 })
        );
        let pmi = env(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")]);
        assert_eq!(launched(pmi).unwrap(), Some(Launch { rank: 1, ranks: 2 }));
    }

    #[test]
    fn the_local_rank_comes_from_whichever_launcher_ran() {
        assert_eq!(local_rank(env(&[])), 0);
        assert_eq!(local_rank(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "3")])), 3);
        assert_eq!(local_rank(env(&[("SLURM_LOCALID", "1")])), 1);
    }

    #[test]
    fn a_garbled_variable_is_named() {
        let e = launched(env(&[("PMI_SIZE", "two")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("PMI_SIZE=\"two\""), "{e}");
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn a_rank_of_a_build_without_mpi_says_how_to_build_one() {
        let e = join(Launch { rank: 1, ranks: 2 }, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }
}
