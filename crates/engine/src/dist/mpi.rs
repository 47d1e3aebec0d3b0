//! The MPI transport (rsmpi over the system's Open MPI or MPICH).

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::traits::{Communicator, CommunicatorCollectives, Root};

use super::{Collectives, DistError, Transport};

/// MPI's world. The universe finalises MPI when dropped, after the last collective.
pub(super) struct Mpi {
    universe: Universe,
    rank: usize,
    ranks: usize,
}

impl Mpi {
    /// Initialises MPI. Serialized threading: the trainer's thread makes every call, but it is
    /// not the thread that initialised MPI.
    pub(super) fn init() -> Result<Mpi, DistError> {
        let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or(DistError::AlreadyInitialised)?;
        let world = universe.world();
        let (rank, ranks) = (world.rank() as usize, world.size() as usize);
        Ok(Mpi {
            universe,
            rank,
            ranks,
        })
    }
}

impl Transport for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    fn sum_f32(&mut self, values: &mut [f32]) {
        let send = values.to_vec();
        self.universe
            .world()
            .all_reduce_into(&send[..], values, SystemOperation::sum());
    }

    fn sum_f64(&mut self, values: &mut [f64]) {
        let send = values.to_vec();
        self.universe
            .world()
            .all_reduce_into(&send[..], values, SystemOperation::sum());
    }

    fn sum_u64(&mut self, values: &mut [u64]) {
        let send = values.to_vec();
        self.universe
            .world()
            .all_reduce_into(&send[..], values, SystemOperation::sum());
    }

    fn max_u64(&mut self, values: &mut [u64]) {
        let send = values.to_vec();
        self.universe
            .world()
            .all_reduce_into(&send[..], values, SystemOperation::max());
    }

    fn gather_u64(&mut self, values: &[u64]) -> Vec<u64> {
        let mut all = vec![0u64; values.len() * self.ranks];
        self.universe.world().all_gather_into(values, &mut all[..]);
        all
    }

    fn gather_f32(&mut self, values: &[f32]) -> Vec<f32> {
        let mut all = vec![0f32; values.len() * self.ranks];
        self.universe.world().all_gather_into(values, &mut all[..]);
        all
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>) {
        let world = self.universe.world();
        let root = world.process_at_rank(0);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
    }

    fn collectives(&self) -> Collectives {
        Collectives::Mpi
    }

    fn reduce_scatter_f32(&mut self, values: &[f32]) -> Vec<f32> {
        let mut mine = vec![0f32; values.len() / self.ranks];
        self.universe.world().reduce_scatter_block_into(
            values,
            &mut mine[..],
            SystemOperation::sum(),
        );
        mine
    }
}
