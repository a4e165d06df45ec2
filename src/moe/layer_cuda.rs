//! `MoELayer` on CUDA: the whole mixture-of-experts forward of [`super::reference::moe_layer`]
//! from the suite's kernels, one launch each: the router's logits (x · W_router, a grouped GEMM
//! of one group on the portable kernel, bf16 logits as a bf16 `nn.Linear` gives them),
//! [`MoeDispatch::route`] (softmax or sigmoid gates), [`MoeDispatch::plan`] (stable, dropless or
//! with a capacity), [`MoeDispatch::dispatch`], the experts' gate and up projections as one
//! grouped GEMM (`[E, H, 2F]` weights), [`MoeDispatch::swiglu`], the down projection as a
//! second grouped GEMM, and [`MoeDispatch::combine`]. bf16 activations and weights as their
//! bits (`u16`), float32 accumulation inside each GEMM, bf16 between the steps.

use cudarc::driver::CudaSlice;

use super::cuda::{Dtype, GroupedKernel, Product};
use super::dispatch_cuda::{DevicePlan, DeviceRouting, MoeDispatch};
use super::reference::Gate;
use crate::gpu::{Gpu, GpuError};

/// One MoE layer's weights on the device: E SwiGLU experts of model width H and expert width
/// F, and the router.
pub struct DeviceExperts {
    /// Experts E.
    pub experts: usize,
    /// Model width H.
    pub hidden: usize,
    /// Expert width F.
    pub width: usize,
    /// W_router `[H, E]`.
    pub router: CudaSlice<u16>,
    /// W_gate and W_up side by side, `[E, H, 2F]`: row i of expert e is W_gate,e\[i\] (F
    /// values) then W_up,e\[i\] (F values).
    pub gate_up: CudaSlice<u16>,
    /// W_down `[E, F, H]`.
    pub down: CudaSlice<u16>,
}

/// What one forward leaves besides its output: the routing and the plan, and the activations
/// [`MoeLayer::backward`] reads (the residuals of the backward).
pub struct LayerState {
    /// Each token's experts and gate weights.
    pub routing: DeviceRouting,
    /// The permutation into expert order.
    pub plan: DevicePlan,
    /// How the gates were formed.
    pub gate: Gate,
    /// The router's logits `[T, E]` as float32 (from its bf16 GEMM).
    pub logits: CudaSlice<f32>,
    /// The tokens' rows in expert order `[T · top_k, H]` (the first `offsets[E]` written).
    pub xd: CudaSlice<u16>,
    /// The gate and up projections `[T · top_k, 2F]`.
    pub gu: CudaSlice<u16>,
    /// SwiGLU's output `[T · top_k, F]`.
    pub act: CudaSlice<u16>,
    /// The experts' outputs `[T · top_k, H]`.
    pub yd: CudaSlice<u16>,
}

/// The gradients [`MoeLayer::backward`] returns (bf16 bits), the float64 definitions those of
/// [`super::reference::LayerGrads`].
pub struct DeviceLayerGrads {
    /// dL/dx `[T, H]`.
    pub dx: CudaSlice<u16>,
    /// dL/dW_router `[H, E]`.
    pub router: CudaSlice<u16>,
    /// dL/dW_gate and dL/dW_up side by side, `[E, H, 2F]` (as [`DeviceExperts::gate_up`]).
    pub gate_up: CudaSlice<u16>,
    /// dL/dW_down `[E, F, H]`.
    pub down: CudaSlice<u16>,
}

/// The compiled kernels of the layer, for one shape of weights (the issue's `MoELayer`).
#[doc(alias = "MoELayer")]
pub struct MoeLayer {
    dispatch: MoeDispatch,
    /// The experts' two grouped GEMMs (the dispatch's pick for K × N = H × 2F and F × H).
    experts_gemm: GroupedKernel,
    /// The router's GEMM (N = E: the portable kernel takes any multiple of 8).
    router_gemm: GroupedKernel,
    /// The shape compiled for: experts E, model width H, expert width F.
    shape: (usize, usize, usize),
    /// Compile and load time of every module, s.
    pub compile_s: f64,
}

impl MoeLayer {
    /// Compiles the layer's kernels for `experts` experts of model width `hidden` and expert
    /// width `width` (once per process each).
    ///
    /// # Errors
    /// [`GpuError::Config`] for E not a multiple of 8 or above 256, or H or F not a multiple of
    /// 8; NVRTC's log; driver errors.
    pub fn new(
        gpu: &Gpu,
        experts: usize,
        hidden: usize,
        width: usize,
    ) -> Result<MoeLayer, GpuError> {
        if experts == 0 || !experts.is_multiple_of(8) || experts > super::dispatch_cuda::MAX_EXPERTS
        {
            return Err(GpuError::Config(format!(
                "MoE layer: {experts} experts; the router's GEMM and the routing take multiples \
                 of 8 up to {}",
                super::dispatch_cuda::MAX_EXPERTS
            )));
        }
        if hidden == 0 || width == 0 || !hidden.is_multiple_of(8) || !width.is_multiple_of(8) {
            return Err(GpuError::Config(format!(
                "MoE layer: H = {hidden} and F = {width} must be positive multiples of 8"
            )));
        }
        let dispatch = MoeDispatch::new(gpu)?;
        let takes_wgmma = super::sm90::takes(&gpu.arch(), experts, hidden, 2 * width)
            && super::sm90::takes(&gpu.arch(), experts, width, hidden);
        let experts_gemm = if takes_wgmma {
            GroupedKernel::named(gpu, "grouped_wgmma", experts, Dtype::Bf16)?
        } else {
            GroupedKernel::named(gpu, "grouped_mma_sync", experts, Dtype::Bf16)?
        };
        let router_gemm = GroupedKernel::named(gpu, "grouped_mma_sync", experts, Dtype::Bf16)?;
        let compile_s = dispatch.compile_s + experts_gemm.compile_s() + router_gemm.compile_s();
        Ok(MoeLayer {
            dispatch,
            experts_gemm,
            router_gemm,
            shape: (experts, hidden, width),
            compile_s,
        })
    }

    /// Checks a call's weights against the shape compiled for and the router's offsets
    /// (`[0, T]`, two values).
    fn check_call(
        &self,
        w: &DeviceExperts,
        router_offsets: &CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        let shape = (w.experts, w.hidden, w.width);
        if shape != self.shape {
            return Err(GpuError::Config(format!(
                "MoE layer compiled for (E, H, F) = {:?}, given weights of {shape:?}",
                self.shape
            )));
        }
        if router_offsets.len() != 2 {
            return Err(GpuError::Config(format!(
                "MoE layer: the router's offsets hold {} values, not 2 ([0, T])",
                router_offsets.len()
            )));
        }
        Ok(())
    }

    /// The experts' GEMM kernel's name (`grouped_wgmma` or `grouped_mma_sync`).
    pub fn experts_kernel(&self) -> &'static str {
        self.experts_gemm.implementation()
    }

    /// The forward on `x` `[T, H]` (bf16): returns out `[T, H]` (bf16) and the routing and
    /// plan. `capacity`: most rows an expert keeps (`None`: dropless). All work is queued on
    /// [`Gpu::stream`]; the host reads nothing back.
    ///
    /// # Errors
    /// [`GpuError::Config`] for weights of another shape than [`MoeLayer::new`] compiled for,
    /// an `x` whose length is not T·H, `top_k` of 0 or above E or 16; out-of-memory and driver
    /// errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        tokens: usize,
        w: &DeviceExperts,
        top_k: usize,
        gate: Gate,
        capacity: Option<usize>,
    ) -> Result<(CudaSlice<u16>, LayerState), GpuError> {
        let router_offsets = Self::router_offsets(gpu, tokens)?;
        let mut out = gpu.stream.alloc_zeros::<u16>(tokens * w.hidden)?;
        let state = self.forward_into(
            gpu,
            x,
            tokens,
            w,
            (top_k, gate, capacity),
            &router_offsets,
            &mut out,
        )?;
        Ok((out, state))
    }

    /// The router GEMM's group offsets for `tokens` tokens, `[0, T]` int32 (uploaded: make
    /// them before a CUDA graph capture of [`MoeLayer::forward_into`]).
    ///
    /// # Errors
    /// [`GpuError::Config`] for T above i32::MAX; driver errors.
    pub fn router_offsets(gpu: &Gpu, tokens: usize) -> Result<CudaSlice<i32>, GpuError> {
        let Ok(t_i) = i32::try_from(tokens) else {
            return Err(GpuError::Config(format!(
                "MoE layer: {tokens} tokens above i32::MAX"
            )));
        };
        Ok(gpu.stream.clone_htod(&[0i32, t_i])?)
    }

    /// [`MoeLayer::forward`] into `out` `[T, H]` with the router's offsets given
    /// ([`MoeLayer::router_offsets`]): nothing is copied from the host, so a CUDA graph can
    /// capture it (the intermediates are stream-ordered allocations). `routing`: (top_k, gate,
    /// capacity) as [`MoeLayer::forward`] takes them.
    ///
    /// # Errors
    /// As [`MoeLayer::forward`]; [`GpuError::Config`] for an `out` or `router_offsets` of
    /// another length.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        tokens: usize,
        w: &DeviceExperts,
        (top_k, gate, capacity): (usize, Gate, Option<usize>),
        router_offsets: &CudaSlice<i32>,
        out: &mut CudaSlice<u16>,
    ) -> Result<LayerState, GpuError> {
        let (e, h, f) = (w.experts, w.hidden, w.width);
        self.check_call(w, router_offsets)?;
        if tokens == 0 || x.len() != tokens * h || out.len() != tokens * h {
            return Err(GpuError::Config(format!(
                "MoE layer: x holds {} elements and out {}; T·H = {tokens}·{h}",
                x.len(),
                out.len()
            )));
        }
        let s = &gpu.stream;
        // The router's logits: one group of T rows times W_router [H, E].
        // SAFETY (each `alloc` below): the buffer's elements that are read are written first;
        // the router's GEMM writes all T × E logits (one group of T rows).
        let mut logits = unsafe { s.alloc::<u16>(tokens * e)? };
        self.router_gemm.launch(
            gpu,
            Product::Forward,
            x,
            &w.router,
            &mut logits,
            router_offsets,
            tokens,
            h,
            e,
        )?;
        // moe_bf16_to_f32 writes all T × E.
        let mut logits_f32 = unsafe { s.alloc::<f32>(tokens * e)? };
        self.dispatch
            .to_f32(gpu, &logits, tokens * e, &mut logits_f32)?;
        let routing = self
            .dispatch
            .route(gpu, &logits_f32, tokens, e, top_k, gate)?;
        let plan = self.dispatch.plan(gpu, &routing, e, capacity)?;
        let rows = plan.max_rows();
        // The dispatch writes every kept row (offsets[E] of them). Rows past a group's end,
        // and past offsets[E] under a capacity, are read by the grouped GEMM's tiles but only
        // ever multiply into output rows that are never stored, so their contents (even
        // non-finite values) reach nothing; the same holds for act below.
        let mut xd = unsafe { s.alloc::<u16>(rows * h)? };
        self.dispatch.dispatch(gpu, x, &plan, h, &mut xd)?;
        // The grouped GEMM writes every kept row; SwiGLU reads only those.
        let mut gu = unsafe { s.alloc::<u16>(rows * 2 * f)? };
        self.experts_gemm.launch(
            gpu,
            Product::Forward,
            &xd,
            &w.gate_up,
            &mut gu,
            &plan.offsets,
            rows,
            h,
            2 * f,
        )?;
        let mut act = unsafe { s.alloc::<u16>(rows * f)? };
        self.dispatch.swiglu(gpu, &gu, &plan, f, &mut act)?;
        // The down projection writes every kept row; the combine reads only those.
        let mut yd = unsafe { s.alloc::<u16>(rows * h)? };
        self.experts_gemm.launch(
            gpu,
            Product::Forward,
            &act,
            &w.down,
            &mut yd,
            &plan.offsets,
            rows,
            f,
            h,
        )?;
        self.dispatch.combine(gpu, &yd, &plan, &routing, h, out)?;
        Ok(LayerState {
            routing,
            plan,
            gate,
            logits: logits_f32,
            xd,
            gu,
            act,
            yd,
        })
    }

    /// The backward of [`MoeLayer::forward_into`] for the output's gradient `dy` `[T, H]`
    /// (bf16), from the forward's `state`: the combine's backward through the permutation's
    /// inverse ([`MoeDispatch::combine_backward`]: each kept row's gradient and each gate
    /// weight's), the down projection's dX and dW (grouped GEMMs), SwiGLU's backward, the gate
    /// and up projections' dX and dW, the gates' backward to the router's logits
    /// ([`MoeDispatch::route_backward`]), the router GEMM's dX and dW, and the gather's
    /// backward, which sums each token's kept rows onto the router's share of dx
    /// ([`MoeDispatch::dispatch_backward`]). bf16 between the steps, float32 inside each. All
    /// work is queued on [`Gpu::stream`]; `router_offsets` as for the forward.
    ///
    /// # Errors
    /// [`GpuError::Config`] for weights of another shape than compiled for, or a `dy` or `x`
    /// whose length is not T·H; out-of-memory and driver errors.
    pub fn backward(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        w: &DeviceExperts,
        state: &LayerState,
        router_offsets: &CudaSlice<i32>,
        dy: &CudaSlice<u16>,
    ) -> Result<DeviceLayerGrads, GpuError> {
        let (e, h, f) = (w.experts, w.hidden, w.width);
        let tokens = state.routing.tokens;
        let s = &gpu.stream;
        // SAFETY: backward_into writes all of each (checked there).
        let mut grads = unsafe {
            DeviceLayerGrads {
                dx: s.alloc::<u16>(tokens * h)?,
                router: s.alloc::<u16>(h * e)?,
                gate_up: s.alloc::<u16>(e * h * 2 * f)?,
                down: s.alloc::<u16>(e * f * h)?,
            }
        };
        let DeviceLayerGrads {
            dx,
            router,
            gate_up,
            down,
        } = &mut grads;
        self.backward_into(
            gpu,
            x,
            w,
            state,
            router_offsets,
            dy,
            [dx, router, gate_up, down],
        )?;
        Ok(grads)
    }

    /// [`MoeLayer::backward`] into given buffers `[dx, router, gate_up, down]`, each written
    /// whole (dW of an expert with no row as zeros): dx `[T, H]`, the router's `[H, E]`, gate
    /// and up's `[E, H, 2F]`, down's `[E, F, H]`.
    ///
    /// # Errors
    /// As [`MoeLayer::backward`], and for buffers of other lengths.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_into(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        w: &DeviceExperts,
        state: &LayerState,
        router_offsets: &CudaSlice<i32>,
        dy: &CudaSlice<u16>,
        [grad_x, grad_router, grad_gate_up, grad_down]: [&mut CudaSlice<u16>; 4],
    ) -> Result<(), GpuError> {
        let (e, h, f) = (w.experts, w.hidden, w.width);
        let tokens = state.routing.tokens;
        let lens = [
            grad_x.len(),
            grad_router.len(),
            grad_gate_up.len(),
            grad_down.len(),
        ];
        if lens != [tokens * h, h * e, e * h * 2 * f, e * f * h] {
            return Err(GpuError::Config(format!(
                "MoE layer backward: gradient buffers of {lens:?} elements; dx, router, gate_up \
                 and down need {:?}",
                [tokens * h, h * e, e * h * 2 * f, e * f * h]
            )));
        }
        self.check_call(w, router_offsets)?;
        if dy.len() != tokens * h || x.len() != tokens * h {
            return Err(GpuError::Config(format!(
                "MoE layer backward: dy holds {} and x {} elements; T·H = {tokens}·{h}",
                dy.len(),
                x.len()
            )));
        }
        let s = &gpu.stream;
        let (plan, routing) = (&state.plan, &state.routing);
        let rows = plan.max_rows();
        let cg = self
            .dispatch
            .combine_backward(gpu, dy, &state.yd, plan, routing, h)?;
        // SAFETY (each `alloc` below): the grouped GEMMs' dX write every kept row, SwiGLU's
        // backward reads only those; rows past offsets[E] reach nothing (as in the forward).
        let mut dact = unsafe { s.alloc::<u16>((rows * f).max(1))? };
        if rows > 0 {
            self.experts_gemm.launch(
                gpu,
                Product::Dx,
                &cg.dyd,
                &w.down,
                &mut dact,
                &plan.offsets,
                rows,
                f,
                h,
            )?;
        }
        self.experts_gemm.launch(
            gpu,
            Product::Dw,
            &state.act,
            &cg.dyd,
            grad_down,
            &plan.offsets,
            rows,
            f,
            h,
        )?;
        let mut dgu = unsafe { s.alloc::<u16>((rows * 2 * f).max(1))? };
        self.dispatch
            .swiglu_backward(gpu, &dact, &state.gu, plan, f, &mut dgu)?;
        let mut dxd = unsafe { s.alloc::<u16>((rows * h).max(1))? };
        if rows > 0 {
            self.experts_gemm.launch(
                gpu,
                Product::Dx,
                &dgu,
                &w.gate_up,
                &mut dxd,
                &plan.offsets,
                rows,
                h,
                2 * f,
            )?;
        }
        self.experts_gemm.launch(
            gpu,
            Product::Dw,
            &state.xd,
            &dgu,
            grad_gate_up,
            &plan.offsets,
            rows,
            h,
            2 * f,
        )?;
        let dlogits = self.dispatch.route_backward(
            gpu,
            &cg.dweights,
            routing,
            &state.logits,
            e,
            state.gate,
        )?;
        // The router GEMM's dX writes all T rows (one group).
        let mut dx_router = unsafe { s.alloc::<u16>(tokens * h)? };
        self.router_gemm.launch(
            gpu,
            Product::Dx,
            &dlogits,
            &w.router,
            &mut dx_router,
            router_offsets,
            tokens,
            h,
            e,
        )?;
        self.router_gemm.launch(
            gpu,
            Product::Dw,
            x,
            &dlogits,
            grad_router,
            router_offsets,
            tokens,
            h,
            e,
        )?;
        self.dispatch
            .dispatch_backward(gpu, &dxd, plan, routing, Some(&dx_router), h, grad_x)?;
        Ok(())
    }
}
