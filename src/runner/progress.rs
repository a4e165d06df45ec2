//! Progress on standard error: an indicatif bar with the case in flight, done/total and the
//! ETA while a terminal watches, and one line per finished row in every case (a log file
//! gets the lines; indicatif hides the bar itself when standard error is not a terminal).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The run's progress.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `total` rows.
    pub fn new(total: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{wide_bar}] {pos}/{len} ETA {eta} {wide_msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        Progress { bar }
    }

    /// Shows what is being measured now.
    pub fn start(&self, what: &str) {
        self.bar.set_message(what.to_string());
    }

    /// Counts one row done and prints `line` above the bar with done/total and the ETA.
    pub fn done(&self, line: &str) {
        self.bar.inc(1);
        let (pos, len) = (self.bar.position(), self.bar.length().unwrap_or(0));
        let eta = self.bar.eta().as_secs();
        self.bar
            .suspend(|| eprintln!("[{pos}/{len} ETA {}:{:02}] {line}", eta / 60, eta % 60));
    }

    /// Prints `line` above the bar without counting a row.
    pub fn note(&self, line: &str) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
