//! `--features phases`: where the put time of the store_full bench goes, per phase of a put batch
//! (`Stats::put_phases`), with the page cache's dirty and writeback bytes before each batch, and the
//! background thread's time (`Stats::background_phases`: compaction steps, replaced journals closed),
//! which no batch waits for. A batch over 50 ms is called the disk's when the disk's own probe (a batch's
//! bytes written + fdatasync, no store) took over 50 ms in the same run and the batch's three syncs
//! (`data_sync`, `evict_append`, `journal_append`: each an append or write and its fdatasync) were most
//! of its time; otherwise the store's. Then where the reopen's time went. (These counters are this tree's:
//! a build of an older store with `phases` does not compile.)
use kvtier_core::store::PageStore;

fn meminfo_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[derive(Default)]
pub struct Phases {
    before: Vec<u64>,
    dirty: (u64, u64),
    /// (batch ms, batch number, per-phase ms, Dirty MB, Writeback MB), the worst kept
    worst: Vec<(f64, usize, Vec<f64>, f64, f64)>,
    sum: Vec<f64>,
    max: Vec<f64>,
    max_dirty: (u64, u64),
    n: usize,
}

impl Phases {
    pub fn start(&mut self, store: &PageStore) {
        self.before = store.stats.put_phases().iter().map(|p| p.1).collect();
        self.dirty = (meminfo_kb("Dirty:"), meminfo_kb("Writeback:"));
        self.max_dirty.0 = self.max_dirty.0.max(self.dirty.0);
        self.max_dirty.1 = self.max_dirty.1.max(self.dirty.1);
    }

    pub fn end(&mut self, store: &PageStore, ms: f64) {
        let now = store.stats.put_phases();
        let d: Vec<f64> = now
            .iter()
            .zip(&self.before)
            .map(|(p, b)| (p.1 - b) as f64 / 1e6)
            .collect();
        self.sum.resize(d.len(), 0.0);
        self.max.resize(d.len(), 0.0);
        for (i, x) in d.iter().enumerate() {
            self.sum[i] += x;
            self.max[i] = self.max[i].max(*x);
        }
        let (dm, wm) = (self.dirty.0 as f64 / 1024.0, self.dirty.1 as f64 / 1024.0);
        self.worst.push((ms, self.n, d, dm, wm));
        self.worst.sort_by(|a, b| b.0.total_cmp(&a.0));
        self.worst.truncate(8);
        self.n += 1;
    }

    pub fn print(&self, store: &PageStore, disk_max_ms: f64) {
        let names: Vec<&str> = store.stats.put_phases().iter().map(|p| p.0).collect();
        println!("put phases (ms): name, mean per batch, max in a batch");
        for (i, n) in names.iter().enumerate() {
            println!(
                "  {n:16} {:8.2} {:8.1}",
                self.sum[i] / self.n.max(1) as f64,
                self.max[i]
            );
        }
        println!(
            "page cache before a batch, max: Dirty {} MB, Writeback {} MB",
            self.max_dirty.0 / 1024,
            self.max_dirty.1 / 1024
        );
        let bg = store.stats.background_phases();
        println!("background thread (ms, whole run; no batch waits for it): name, total");
        for (n, ns) in bg.iter().filter(|p| p.1 > 0) {
            println!("  {n:16} {:10.1}", *ns as f64 / 1e6);
        }
        let syncs: Vec<usize> = names
            .iter()
            .enumerate()
            .filter(|(_, n)| ["data_sync", "evict_append", "journal_append"].contains(n))
            .map(|(i, _)| i)
            .collect();
        println!(
            "worst batches: batch ms, #, Dirty/Writeback MB before it, whose (over 50 ms), phases over 1 ms"
        );
        for (ms, n, d, dm, wm) in &self.worst {
            let synced: f64 = syncs.iter().map(|&i| d[i]).sum();
            let whose = match *ms > 50.0 {
                false => "",
                true if disk_max_ms > 50.0 && synced >= ms / 2.0 => "disk ",
                true => "store",
            };
            let big: Vec<String> = names
                .iter()
                .zip(d)
                .filter(|(_, x)| **x >= 1.0)
                .map(|(k, x)| format!("{k} {x:.1}"))
                .collect();
            println!(
                "  {ms:7.1} #{n:<6} {dm:6.0}/{wm:<6.0} {whose:5} {}",
                big.join(", ")
            );
        }
    }
}

/// Where the reopen's time went (`OpenReport::open_phase_ns`).
pub fn print_open(store: &PageStore) {
    let phases: Vec<String> = store
        .open_report()
        .open_phase_ns
        .iter()
        .map(|(n, ns)| format!("{n} {:.2} s", *ns as f64 / 1e9))
        .collect();
    println!("reopen by phase: {}", phases.join(", "));
}
