//! Where objects live and how much room they may take: the data files of each size class and their blocks
//! (`files`), the file-system steps every store file shares (`disk`), the limits a namespace's occupancy is
//! kept within (`capacity`) and the budget of the whole store directory its namespaces share (`budget`).

pub(super) mod budget;
pub(super) mod capacity;
pub(super) mod disk;
pub(super) mod files;
